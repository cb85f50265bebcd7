-- fair.lua: one rate shared fairly among the keys active at the same time (`fair: true`).
--
-- A total schedule at the limit's full rate (GCRA: interval T = 1 / rate, burst B), and one
-- schedule per key at its share of that rate: share = w / W, with w the key's weight and W
-- the sum of the weights of the keys active now (this key included), recomputed on every
-- call. Both reach at most the near horizon H ahead (horizon_us: 0.5 s, or B + 1 intervals
-- of a slow limit; less when the caller's max_wait_us is shorter):
--   1 on schedule: a key whose schedule is at most H ahead of now takes the total's next
--     slot when that is within H, and its schedule moves on by one share interval;
--   2 spare capacity: a key further ahead still takes the total's slot when it is free at
--     once (nobody due wanted it), uncharged;
--   3, 4 otherwise denied: the total is booked H ahead (3) or the key has had its share (4),
--     and told to come back at its planned time.
-- Work conserving, and what it costs: a key may run its schedule up to H ahead of now, so
-- a key whose tasks come back late (a busy fleet) leaves its slots to keys that are there,
-- which may use H more than their share in the short run, never more over time (their
-- schedules stop them); a newcomer's first slot may wait up to H behind slots booked
-- before it. A key counts in W only while its schedule is ahead of now or its tasks are
-- planned: a key asking less than its share counts for about the fraction of the time its
-- calls use, so the others share what it leaves (max-min fair), and a key that stops
-- leaves W as soon as its schedule and plan have passed.
-- The plan: a cursor per key, moved on by one share interval per denial, from when the key
-- may take a slot again (its schedule less H, the total's next slot less H): the key's
-- waiting tasks come back one share interval apart, each when it can reserve, and one that
-- comes back late finds its key still on schedule. It reaches at most plan_us ahead (3 s, or
-- four of the key's intervals), then starts over among the earlier times: a waiting task
-- looks again at least that often (and sees shares that changed meanwhile).
-- No key books the future first come first served: nothing is reserved beyond H.
--
-- KEYS (nkeys = 3, from k):
--   KEYS[k]     the key's state: STRING, two doubles '<dd': tk = the key's TAT on its own
--               schedule (us), plan = the key's plan cursor (us): where the next task that
--               has had its share is told to come back. The key is active until both
--               have passed; then it expires (a second later).
--   KEYS[k+1]   the limit's shared HASH: 't' = the total TAT (us), 'W' = the sum of the
--               weights of the active keys, 'T' = the interval T the schedules were
--               written under (us; absent from an older version's), and one field per
--               active key (its state key's name) = its weight. A rate raised since
--               (celery throttle set or clear) shortens what the total's and the keys'
--               schedules and plans are ahead of now in proportion, as gcra.lua does.
--   KEYS[k+2]   the limit's active keys: ZSET state key name -> active until (us).
-- The ARGV of a fair limit: count = the key's weight w, period_us = w / rate, so that
-- count / period_us is still the limit's rate (the weight of the key rides in the pair);
-- burst = B, the total's burst.
--
-- Replies: as every algorithm's (prelude.lua); nothing of this file reaches the caller.
-- check hands commit and deny s1 = a table of what it read and decided.

local function horizon_us(interval, burst)
  return math.max(500000, (burst + 1) * interval)
end
local function plan_us(key_interval, cost)
  return math.max(3000000, 4 * cost * key_interval)
end

local function check(k, count, period_us, burst, now, cost, max_wait)
  local w = count
  local interval = period_us / count
  local member, shared, active = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local got = redis.call('HMGET', shared, 't', 'W', member, 'T')
  local was = tonumber(got[4])
  local scale = was and interval < was and interval / was
  local t = tonumber(got[1]) or now
  if scale and t > now then
    t = now + (t - now) * scale
  end
  t = math.max(t, now)
  local sum = tonumber(got[2]) or 0
  local known = tonumber(got[3])
  -- Keys whose activity ended leave the sum (a bounded batch per call).
  local gone = redis.call('ZRANGEBYSCORE', active, '-inf', now, 'LIMIT', 0, 100)
  if #gone > 0 and #gone == redis.call('ZCARD', active) then
    sum, known = 0, nil  -- every key left: start from an exact 0, without rounding residue
  elseif #gone > 0 then
    local weights = redis.call('HMGET', shared, unpack(gone))
    for i = 1, #gone do
      sum = sum - (tonumber(weights[i]) or 0)
      if gone[i] == member then
        known = nil
      end
    end
  end
  if known then
    sum = sum - known
  end
  sum = math.max(sum, 0) + w
  local tk, plan = now, now
  local s = redis.call('GET', member)
  if s then
    tk, plan = struct.unpack('<dd', s)
    if scale then
      tk = tk > now and now + (tk - now) * scale or tk
      plan = plan > now and now + (plan - now) * scale or plan
    end
  end
  local key_interval = interval * sum / w
  local slot = math.max(now, t + (cost - burst) * interval)
  local near = horizon_us(interval, burst)
  local due = math.max(tk, now) + (cost - 1) * key_interval - near
  local horizon = math.min(max_wait, near)
  -- mode: 1 on schedule, 2 spare capacity, 3 denied by the total, 4 denied by its share
  local mode, allowed, wait, retry, after = 3, 0, 0, 0, t
  local start = plan
  if due <= now and slot - now <= horizon then
    mode, allowed, wait, after = 1, 1, ceil_us(slot - now), t + cost * interval
  elseif due > now and slot <= now then
    mode, allowed, after = 2, 1, t + cost * interval
  else
    if due > now then
      mode = 4
    end
    start = math.max(plan, due, slot - horizon)
    if start > now + plan_us(key_interval, cost) then
      -- the plan starts over: later tasks come back among the earlier ones
      start = math.max(due, slot - horizon)
    end
    retry = ceil_us(start - now)
  end
  return allowed, wait, retry, math.max(burst - (after - now) / interval, 0),
         ceil_us(after - now),
         {mode, t, sum, gone, known, tk, plan, key_interval, start, slot, interval}
end

-- The shared part of commit and deny: the key is active until `until`, its weight in the
-- sum, the keys whose activity ended out of it; the TTLs of the limit's keys.
local function fair_write(k, w, now, total, r, tk, plan)
  local member, shared, active = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local gone = r[4]
  if #gone > 0 then
    redis.call('ZREM', active, unpack(gone))
    redis.call('HDEL', shared, unpack(gone))
  end
  local until_us = math.max(tk, plan, now)
  redis.call('ZADD', active, until_us, member)
  redis.call('HSET', shared, 't', total, 'W', r[3], member, w, 'T', r[11])
  redis.call('SET', member, struct.pack('<dd', tk, plan), 'PX', ttl_ms(until_us - now))
  local last = redis.call('ZRANGE', active, -1, -1, 'WITHSCORES')
  local ttl = ttl_ms(math.max(tonumber(last[2]), total) - now)
  redis.call('PEXPIRE', shared, ttl)
  redis.call('PEXPIRE', active, ttl)
end

-- Committed as of a later time `at` (several limits: the slot another limit set), the
-- total and the key's schedule take the cost at `at`, as gcra.lua does: the slots before it
-- that nobody took stay unused.
local function commit(k, count, period_us, burst, now, cost, holder, expiry, at, r)
  local interval = period_us / count
  local total = math.max(r[2], now) + cost * interval
  if at and at > r[2] then
    total = at + cost * interval
  end
  local tk, mark = r[6], ''
  if r[1] == 1 then
    tk = math.max(tk, at or r[10]) + cost * r[8]
    mark = string.format('%.17g', r[8])
  end
  fair_write(k, count, now, total, r, tk, r[7])
  return mark
end

-- A denied acquisition (acquire.lua calls it for every limit whose check denied): the key
-- is active, and a key denied by its share moves its plan on by one task.
local function deny(k, count, period_us, burst, now, cost, r)
  fair_write(k, count, now, r[2], r, r[6], r[9] + cost * r[8])
end

-- ==== several limits only: acquire_one.lua is sent without the rest of this file ====

ALGO.fair = {
  nkeys = 3,
  check = check,
  commit = commit,
  deny = deny,
  -- delta > 0 pushes the total's TAT (and the key's, at the share it was charged at)
  -- later; delta < 0 pulls them back, never earlier than now.
  adjust = function(k, count, period_us, burst, now, delta, mark, holder)
    local shared = KEYS[k + 1]
    local t = tonumber(redis.call('HGET', shared, 't'))
    if t then
      t = math.max(now, math.max(t, now) + delta * period_us / count)
      redis.call('HSET', shared, 't', t)
      -- A charge may push the total past the limit's keys' lifetime: they live until it.
      local ttl = math.max(redis.call('PTTL', shared), ttl_ms(t - now))
      redis.call('PEXPIRE', shared, ttl)
      redis.call('PEXPIRE', KEYS[k + 2], ttl)
    end
    local s = redis.call('GET', KEYS[k])
    if s and mark ~= '' then
      local tk, plan = struct.unpack('<dd', s)
      local ttl = redis.call('PTTL', KEYS[k])
      tk = math.max(now, math.max(tk, now) + delta * tonumber(mark))
      redis.call('SET', KEYS[k], struct.pack('<dd', tk, plan), 'PX',
                 math.max(ttl, ttl_ms(tk - now)))
    end
  end,
}
