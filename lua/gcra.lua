-- gcra.lua: Generic Cell Rate Algorithm, the leaky bucket kept as one timestamp.
--
-- State: one STRING per (limit, key) = TAT, the theoretical arrival time in us, when the
-- key's TTL ends (us; prelude.lua's lifetime) and the emission interval T it was written
-- under (us), packed as three doubles (struct '<ddd': exact, and cheaper than formatting
-- and parsing text; '<dd' and '<d' by older versions). A rate raised since (celery throttle
-- set or clear, a learned rate probing up) shortens the debt ahead of now in proportion:
-- the tokens owed stay owed, at the new T (one call at 1/h then back to 5000/h owes 0.72 s,
-- not an hour), converted once, by the first read under the new T, which stores it. A rate lowered keeps the debt as it stands, as the spacing guard does.
-- Emission interval T = period_us / count (us per token); tolerance = burst * T.
-- A request of `cost` tokens conforms at time t when  max(TAT, t) + cost*T - t <= burst*T.
-- With burst = 1 and cost = 1 that is strict spacing: one call every T.
-- Reservation (the queue of the leaky bucket, kept as that single timestamp): with
-- max_wait_us > 0 a request that conforms within max_wait_us takes the next free slot now;
-- `wait` is how long until that slot.
-- A missing key reads as TAT = now (a full bucket); the key expires when TAT has passed.
-- After a restart's fence (FENCE, prelude.lua), a missing key reads as a bucket that was
-- empty at the fence's end (TAT = FENCE + burst * T), refilling from there.
-- check hands commit s1 = the TAT to store if admitted (with cost 0: the TAT it read) and
-- s2 = the TAT it read (max(stored, now)), s3 = when the key's TTL ends (false: no key).
-- Committed as of a later time `at` (several
-- limits: the slot another limit set), the cost is taken at max(TAT, at): the slots before
-- `at` that nobody took stay unused, exactly as if the request had arrived at `at`.

local function check(k, count, period_us, burst, now, cost, max_wait, s)
  local interval = period_us / count
  local tat, lives = now, false
  if s == nil then
    s = redis.call('GET', KEYS[k])
  end
  if not s and FENCE > 0 then
    tat = math.max(now, FENCE + burst * interval)
  elseif s then
    if #s == 24 then
      local was
      tat, lives, was = struct.unpack('<ddd', s)
      if interval < was and tat > now then
        -- Stored at once, denied or not: converted again from the old TAT on each read,
        -- the debt would shrink at new/old of real time, and a caller denied (which writes
        -- nothing) would be told about its old slot, less a little, on every try.
        tat = now + (tat - now) * interval / was
        local px
        lives, px = lifetime(tat - now, now, lives)
        store(k, struct.pack('<ddd', tat, lives, interval), px)
      end
    elseif #s == 16 then
      tat, lives = struct.unpack('<dd', s)  -- by a version that did not keep T
    else
      tat = struct.unpack('<d', s)  -- by a version that did not keep the TTL's end
    end
    tat = now > tat and now or tat  -- math.max(tat, now), without a C call
  end
  local new_tat = tat + cost * interval
  local conform_at = new_tat - burst * interval
  local allowed, wait, retry, after = 0, 0, 0, tat
  if conform_at <= now then
    allowed, after = 1, new_tat
  else
    local need = ceil_us(conform_at - now)
    if need <= max_wait then
      allowed, wait, after = 1, need, new_tat
    else
      retry = need
    end
  end
  local remaining = burst - (after - now) / interval
  return allowed, wait, retry, 0 > remaining and 0 or remaining, ceil_us(after - now), new_tat,
         tat, lives
end

local function commit(k, count, period_us, burst, now, cost, holder, expiry, at, tat, read,
                      lives)
  local later = at and at > read
  if later then
    tat = at + cost * period_us / count
  end
  local px
  lives, px = lifetime(tat - now, now, lives)
  store(k, struct.pack('<ddd', tat, lives, period_us / count), px)
  if later then
    -- The decision describes the state committed (check's formulas on the new TAT).
    local interval = period_us / count
    return '', ceil_us(tat - now), math.max(burst - (tat - now) / interval, 0)
  end
  return ''
end

-- ==== several limits only: acquire_one.lua is sent without the rest of this file ====

ALGO.gcra = {
  nkeys = 1,
  check = check,
  commit = commit,
  -- delta > 0 pushes TAT later; delta < 0 pulls it back, never earlier than now.
  adjust = function(k, count, period_us, burst, now, delta, mark, holder)
    local _, _, _, _, _, tat, _, lives = check(k, count, period_us, burst, now, 0, 0)
    commit(k, count, period_us, burst, now, 0, holder, nil, false,
           math.max(now, tat + delta * period_us / count), tat, lives)
  end,
}
