-- token_bucket.lua: a bucket of `burst` tokens refilled continuously at count/period.
--
-- State: one STRING per (limit, key): tokens at time ts (us) and when the key's TTL ends
-- (us; prelude.lua's lifetime), packed as three doubles (struct '<ddd': exact, and one
-- SET ... PX writes the state and its TTL together, or SETRANGE keeps the TTL). Tokens
-- may be negative: a debt left by a reservation or a charge. A missing key reads as a full
-- bucket; the key expires once the bucket would be full again. After a restart's fence
-- (FENCE, prelude.lua), a missing key reads as a bucket that was empty at the fence's end
-- (in debt before it), refilling from there.
-- Rate = count / period_us tokens per us; capacity = burst.
-- Reservation: with max_wait_us > 0 a request that must wait at most max_wait_us is admitted,
-- the bucket goes into debt and `wait` says how long until the tokens really exist.
-- check hands commit the level it read: s1 = tokens, s2 = ts, s3 = when the key's TTL
-- ends (false: no key). Committed as of a later time
-- `at` (several limits: the slot another limit set), the cost is taken from the level at
-- `at`, capped at the burst there: the refill of the time before `at` that nobody used is
-- not banked for later (commit then returns the reset and remaining of the level it
-- committed). The state stays at ts (never in the future, where a call made
-- before `at` would read the level of `at`): tokens = min(tokens, burst - refill to `at`).

local function check(k, count, period_us, burst, now, cost, max_wait, s)
  local tokens, ts, lives = burst, now, false
  if s == nil then
    s = redis.call('GET', KEYS[k])
  end
  if not s and FENCE > 0 then
    tokens = math.min(burst, (now - FENCE) * count / period_us)
  elseif s then
    if #s == 24 then
      tokens, ts, lives = struct.unpack('<ddd', s)
    else
      -- Two doubles: written by a version that did not keep the TTL's end (a fleet being
      -- upgraded); its TTL is set again, in this format.
      tokens, ts = struct.unpack('<dd', s)
    end
    -- ts is never moved backwards: a clock step back must not refill the same time twice.
    if now > ts then
      tokens = tokens + (now - ts) * count / period_us
      ts = now
    end
    -- Capped even when no time passed: a burst lowered at run time applies at once.
    tokens = tokens < burst and tokens or burst  -- math.min(burst, tokens), without a C call
  end
  local allowed, wait, retry, after = 0, 0, 0, tokens
  if tokens >= cost then
    allowed, after = 1, tokens - cost
  else
    local need = ceil_us((cost - tokens) * period_us / count)
    if need <= max_wait then
      allowed, wait, after = 1, need, tokens - cost
    else
      retry = need
    end
  end
  return allowed, wait, retry, 0 > after and 0 or after,
         ceil_us((burst - after) * period_us / count), tokens, ts, lives
end

local function commit(k, count, period_us, burst, now, cost, holder, expiry, at, tokens, ts,
                      lives)
  local later = at and at > ts
  if later then
    tokens = math.min(tokens, burst - (at - ts) * count / period_us)
  end
  tokens = tokens - cost
  local to_full = (burst - tokens) * period_us / count
  local px
  lives, px = lifetime((0 > to_full and 0 or to_full) + (ts - now), now, lives)
  store(k, struct.pack('<ddd', tokens, ts, lives), px)
  if later then
    -- The decision describes the state committed (check's formulas on the new level).
    return '', ceil_us((burst - tokens) * period_us / count), math.max(tokens, 0)
  end
  return ''
end

-- ==== several limits only: acquire_one.lua is sent without the rest of this file ====

ALGO.tb = {
  nkeys = 1,
  check = check,
  commit = commit,
  -- delta > 0 charges extra tokens (may leave a debt), delta < 0 refunds (never above burst).
  adjust = function(k, count, period_us, burst, now, delta, mark, holder)
    local _, _, _, _, _, tokens, ts, lives = check(k, count, period_us, burst, now, 0, 0)
    commit(k, count, period_us, burst, now, 0, holder, nil, false,
           math.min(burst, tokens - delta), ts, lives)
  end,
}
