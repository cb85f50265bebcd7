-- acquire_series.lua: several acquisitions of one limit and key, each on its own, each
-- dated when it was asked: acquire_one.lua's decision for each of them in turn, in one call.
--
-- For callers that gather asks and send them together (the shadow looks of a process,
-- Limiter.acquire_each): one call per limit and key instead of one per ask, which is most
-- of what a gathered ask costs the server and the client. Sent as acquire_one.lua is (the
-- prelude and the limit's algorithm file, each up to its "several limits only" line).
--
-- KEYS[1]      the namespace's holds (HASH, see hold.lua)
-- KEYS[2]      the limit's state key
-- ARGV[1]      now_us        '' = read Redis TIME (always, outside tests)
-- ARGV[2]      max_wait_us   as acquire.lua, for each ask
-- ARGV[3..5]   count, period_us, burst of the limit
-- ARGV[6..7]   the two hold fields of the limit: the whole limit's, this key's ('' if none)
-- ARGV[8]      fence_us      the restart fence (prelude.lua), with its marker in KEYS[3];
--                            '' = no fence
-- ARGV[9..]    per ask, in the order they are taken: ago_us (>= 0: the ask is taken as
--              of now_us less it), cost
-- Not for concurrency or fair limits (their state is not one key's).
--
-- Returns per ask, in order, acquire_one.lua's five doubles packed '<ddddd': allowed (1/0;
-- 2 when its cost exceeds the capacity, the rest 0), wait_us, retry_after_us, remaining,
-- reset_us. A denial writes nothing; a hold denies every ask dated within it.

local base = clock_us(ARGV[1])
local live = REDIS_CLOCK
if ARGV[8] ~= '' then
  FENCE = fence_of(3, base, tonumber(ARGV[8]))
end
local count, period_us, burst = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local max_wait = tonumber(ARGV[2])
local held = redis.call('HMGET', KEYS[1], ARGV[6], ARGV[7])
local hold = 0
if held[1] or held[2] then
  hold = math.max(tonumber(held[1]) or 0, tonumber(held[2]) or 0)
end
local out = {}
for i = 9, #ARGV, 2 do
  local ago = tonumber(ARGV[i])
  local now = base - ago
  -- As acquire_one.lua dated back (clock_us of a negative time): not the live clock.
  REDIS_CLOCK = live and ago == 0
  local cost = tonumber(ARGV[i + 1])
  if cost > burst then
    out[#out + 1] = struct.pack('<ddddd', 2, 0, 0, 0, 0)
  elseif hold > now then
    out[#out + 1] = struct.pack('<ddddd', 0, 0, ceil_us(hold - now), 0, 0)
  else
    local allowed, wait, retry, remaining, reset, s1, s2, s3, s4 =
      check(2, count, period_us, burst, now, cost, max_wait)
    if allowed == 1 then
      commit(2, count, period_us, burst, now, cost, nil, nil, false, s1, s2, s3, s4)
    end
    out[#out + 1] = struct.pack('<ddddd', allowed, wait, retry, remaining, reset)
  end
end
return table.concat(out)
