-- sliding_window.lua: sliding-window counter, O(1) memory per key.
--
-- The count over the last period_us is estimated as
--   previous_window_count * (1 - fraction_of_current_window_elapsed) + current_window_count
-- (Cloudflare's approximation). It removes the 2 x burst of a fixed window at its edge.
--
-- State: one STRING per (limit, key): w = the current window index, c = its count, p = the
-- count of window w - 1 and the period_us they count in, packed as four doubles (struct
-- '<dddd'; '<ddd' by older versions, read as of the period now; one SET ... PX writes
-- state and TTL). A period changed since (a rate set at run time, a key moved to another
-- plan) makes the stored index one of other units: the stored window's count stays
-- counted, in full in the current window, while its own window runs (a denial meanwhile
-- names when the new windows' estimate lets it in, though the old window may end sooner). The key expires when its count no longer weighs on the estimate, at the
-- end of window w + 1: set by the window's first write, the TTL is kept by the others
-- (SETRANGE: see lifetime in prelude.lua). Reservation is not supported (max_wait ignored).
-- mark = the window index the cost was counted in.
-- If Redis TIME steps back into an earlier window, counting goes on in the stored, later
-- window, with no credit for the time elapsed in it.
-- check hands commit the window and its counts: s1 = w, s2 = cur, s3 = prev, s4 = whether
-- the key holds that window already (its TTL is the window's).

local function check(k, count, period_us, burst, now, cost, max_wait, s)
  -- The current window and its two counts: floor(now / period_us), or the stored window
  -- when it is later (the clock stepped back).
  local w, cur, prev, same = math.floor(now / period_us), 0, 0, false
  if s == nil then
    s = redis.call('GET', KEYS[k])
  end
  if s then
    local stored, c, p = struct.unpack('<ddd', s)
    local stored_p = #s >= 32 and struct.unpack('<d', s, 25) or period_us
    if stored_p ~= period_us then
      if (stored + 1) * stored_p > now then
        cur = c
      end
    elseif stored == w - 1 then
      prev = c
    elseif stored >= w then
      w, cur, prev, same = stored, c, p, true
    end
  end
  local start = w * period_us
  local est = prev * (1 - math.max(now - start, 0) / period_us) + cur
  local allowed, retry, after_cur = 0, 0, cur
  if est + cost <= count then
    allowed = 1
    est = est + cost
    after_cur = cur + cost
  elseif cur + cost <= count then
    -- Enough room once the previous window has decayed a little more, in this window.
    local f = 1 - (count - cur - cost) / prev
    retry = ceil_us(start + f * period_us - now)
  else
    -- Only in the next window, once this window's count has decayed enough.
    local f = math.max(1 - (count - cost) / cur, 0)
    retry = ceil_us(start + (1 + f) * period_us - now)
  end
  local reset
  if after_cur > 0 then
    reset = ceil_us(start + 2 * period_us - now)
  else
    reset = ceil_us(start + period_us - now)
  end
  return allowed, 0, retry, math.max(count - est, 0), reset, w, cur, prev, same
end

local function commit(k, count, period_us, burst, now, cost, holder, expiry, at, w, cur, prev,
                      same)
  store(k, struct.pack('<dddd', w, cur + cost, prev, period_us),
        not (same and REDIS_CLOCK) and ttl_ms((w + 2) * period_us - now))
  return w
end

-- ==== several limits only: acquire_one.lua is sent without the rest of this file ====

ALGO.sw = {
  nkeys = 1,
  check = check,
  commit = commit,
  -- A call is counted in window w (s1): its admission holds until that window ends.
  ends = function(period_us, w)
    return (w + 1) * period_us
  end,
  -- A charge lands in the current window; a refund goes back to the window that paid while
  -- that window still weighs on the estimate (the current or the previous one).
  adjust = function(k, count, period_us, burst, now, delta, mark, holder)
    local _, _, _, _, _, w, cur, prev, same = check(k, count, period_us, burst, now, 0, 0)
    local paid = tonumber(mark)
    if delta > 0 or paid == w then
      cur = math.max(cur + delta, 0)
    elseif paid == w - 1 then
      prev = math.max(prev + delta, 0)
    else
      return
    end
    commit(k, count, period_us, burst, now, 0, holder, nil, false, w, cur, prev, same)
  end,
}
