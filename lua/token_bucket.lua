-- token_bucket.lua: a bucket of `burst` tokens refilled continuously at `rate` tokens/s.
--
-- State: one HASH per (limit, key)
--   t  = tokens at ts (may be negative: a debt left by a reservation or a charge)
--   ts = time of that reading, us
-- A missing key reads as a full bucket; the key expires once the bucket would be full again.
--
-- Parameters p: p.count tokens per p.period_us, so rate = count / period_us tokens per us;
--               p.burst = capacity in tokens.
-- Reservation: with max_wait_us > 0 a request that must wait at most max_wait_us is admitted,
-- the bucket goes into debt and `wait` says how long until the tokens really exist.

local function tb_level(key, p, now)
  local s = redis.call('HMGET', key, 't', 'ts')
  local tokens = tonumber(s[1])
  if tokens == nil then
    return p.burst, now
  end
  local ts = tonumber(s[2])
  if now > ts then
    tokens = math.min(p.burst, tokens + (now - ts) * p.count / p.period_us)
    ts = now
  end
  -- ts is never moved backwards: a clock step back must not refill the same time twice.
  return tokens, ts
end

local function tb_store(key, p, now, tokens, ts)
  redis.call('HSET', key, 't', fmt(tokens), 'ts', fmt(ts))
  local to_full = (p.burst - tokens) * p.period_us / p.count
  redis.call('PEXPIRE', key, ttl_ms(math.max(to_full, 0) + (ts - now)))
end

ALGO.tb = {
  nkeys = 1,
  -- -> state table {allowed, wait, retry, remaining, reset, ...private}
  check = function(keys, p, now, cost, max_wait)
    local tokens, ts = tb_level(keys[1], p, now)
    local r = {tokens = tokens, ts = ts, allowed = 0, wait = 0, retry = 0}
    if tokens >= cost then
      r.allowed = 1
    else
      local need = ceil_us((cost - tokens) * p.period_us / p.count)
      if need <= max_wait then
        r.allowed = 1
        r.wait = need
      else
        r.retry = need
      end
    end
    local after = tokens
    if r.allowed == 1 then
      after = tokens - cost
    end
    r.remaining = math.max(after, 0)
    r.reset = ceil_us((p.burst - after) * p.period_us / p.count)
    return r
  end,
  commit = function(keys, p, now, cost, r, holder, expiry)
    tb_store(keys[1], p, now, r.tokens - cost, r.ts)
    return ''
  end,
  -- delta > 0 charges extra tokens (may leave a debt), delta < 0 refunds (never above burst).
  adjust = function(keys, p, now, delta, mark, holder)
    local tokens, ts = tb_level(keys[1], p, now)
    tb_store(keys[1], p, now, math.min(p.burst, tokens - delta), ts)
  end,
}
