-- token_bucket.lua: a bucket of `burst` tokens refilled continuously at count/period.
--
-- State: one HASH per (limit, key): t = tokens at time ts (us). Tokens may be negative: a debt left by a reservation or a charge. A missing key reads as a full
-- bucket; the key expires once the bucket would be full again.
-- Rate = count / period_us tokens per us; capacity = burst.
-- Reservation: with max_wait_us > 0 a request that must wait at most max_wait_us is admitted,
-- the bucket goes into debt and `wait` says how long until the tokens really exist.
-- Private fields of l: tokens, ts (the level read by check).

local function tb_level(l, now)
  local s = redis.call('HMGET', KEYS[l.k], 't', 'ts')
  local tokens = tonumber(s[1])
  if tokens == nil then
    return l.burst, now
  end
  local ts = tonumber(s[2])
  if now > ts then
    tokens = math.min(l.burst, tokens + (now - ts) * l.count / l.period_us)
    ts = now
  end
  -- ts is never moved backwards: a clock step back must not refill the same time twice.
  return tokens, ts
end

local function tb_store(l, now, tokens, ts)
  local to_full = (l.burst - tokens) * l.period_us / l.count
  redis.call('HSET', KEYS[l.k], 't', tokens, 'ts', ts)
  redis.call('PEXPIRE', KEYS[l.k], ttl_ms(math.max(to_full, 0) + (ts - now)))
end

ALGO.tb = {
  nkeys = 1,
  check = function(l, now, cost, max_wait)
    local tokens, ts = tb_level(l, now)
    l.tokens, l.ts = tokens, ts
    local after = tokens
    if tokens >= cost then
      l.allowed = 1
      after = tokens - cost
    else
      local need = ceil_us((cost - tokens) * l.period_us / l.count)
      if need <= max_wait then
        l.allowed = 1
        l.wait = need
        after = tokens - cost
      else
        l.retry = need
      end
    end
    l.remaining = math.max(after, 0)
    l.reset = ceil_us((l.burst - after) * l.period_us / l.count)
  end,
  commit = function(l, now, cost, holder, expiry)
    tb_store(l, now, l.tokens - cost, l.ts)
    return ''
  end,
  -- delta > 0 charges extra tokens (may leave a debt), delta < 0 refunds (never above burst).
  adjust = function(l, now, delta, mark, holder)
    local tokens, ts = tb_level(l, now)
    tb_store(l, now, math.min(l.burst, tokens - delta), ts)
  end,
}
