-- fixed_window.lua: at most `count` per window of period_us, windows aligned to the Unix
-- epoch (a "/d" window runs 00:00-24:00 UTC). Cheap and exact for hour or day quotas; at a
-- window edge up to 2 x count can pass within a short time, so use GCRA or a token bucket
-- to shape short-term traffic and this for the quota on top.
--
-- State: one STRING per (limit, key): w = window index floor(now / period_us), n = the
-- cost counted in it and the period_us it counts in, packed as three doubles (struct
-- '<ddd'; '<dd' by older versions, read as of the period now; one SET ... PX writes state
-- and TTL). A period changed since (a rate set at run time, a key moved to another plan)
-- makes the stored index one of other units: its count stays counted, in the window of
-- the new period, while its own window runs (a per-minute index read as hours would be
-- a window thousands of years ahead, denying everything until the key expired). A denial
-- meanwhile names the new window's end, though the old window may end sooner. The key expires when its window ends: set by the window's first write, the TTL
-- is kept by the others (SETRANGE: see lifetime in prelude.lua). Reservation is not supported (max_wait is
-- ignored). mark (kept in the lease record) = the window index the cost was counted in, so
-- that a refund only returns cost to the window that paid.
-- If Redis TIME steps back into an earlier window, counting goes on in the stored, later
-- window: a step back must not reopen a window that is full.
-- check hands commit the window and its count: s1 = w, s2 = n, s3 = whether the key holds
-- that window already (its TTL is the window's).

local function check(k, count, period_us, burst, now, cost, max_wait, s)
  -- The window now counts in: floor(now / period_us), or the stored window when it is
  -- later (the clock stepped back).
  local w, n, same = math.floor(now / period_us), 0, false
  if s == nil then
    s = redis.call('GET', KEYS[k])
  end
  if s then
    local stored, stored_n = struct.unpack('<dd', s)
    local stored_p = #s >= 24 and struct.unpack('<d', s, 17) or period_us
    if stored_p ~= period_us then
      if (stored + 1) * stored_p > now then
        n = stored_n
      end
    elseif stored >= w then
      w, n, same = stored, stored_n, true
    end
  end
  local window_end = ceil_us((w + 1) * period_us - now)
  local allowed, retry, after = 0, 0, n
  if n + cost <= count then
    allowed, after = 1, n + cost
  else
    retry = window_end
  end
  local remaining = count - after
  return allowed, 0, retry, 0 > remaining and 0 or remaining, window_end, w, n, same
end

local function commit(k, count, period_us, burst, now, cost, holder, expiry, at, w, n, same)
  store(k, struct.pack('<ddd', w, n + cost, period_us),
        not (same and REDIS_CLOCK) and ttl_ms((w + 1) * period_us - now))
  return w
end

-- ==== several limits only: acquire_one.lua is sent without the rest of this file ====

ALGO.fw = {
  nkeys = 1,
  check = check,
  commit = commit,
  -- A call is counted in window w (s1): its admission holds until that window ends.
  ends = function(period_us, w)
    return (w + 1) * period_us
  end,
  -- A charge lands in the current window; a refund only in the window that paid, if current.
  adjust = function(k, count, period_us, burst, now, delta, mark, holder)
    local _, _, _, _, _, w, n, same = check(k, count, period_us, burst, now, 0, 0)
    if delta < 0 and tonumber(mark) ~= w then
      return
    end
    commit(k, count, period_us, burst, now, 0, holder, nil, false, w, math.max(n + delta, 0),
           same)
  end,
}
