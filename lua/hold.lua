-- hold.lua: hold a limit, or one key of it, so that nothing is admitted until a time; or
-- lift a hold.
--
-- Holds serve the upstream's word (a 429 with Retry-After: the whole fleet stops until the
-- upstream's reset, instead of each worker finding out by its own 429) and the operator's
-- brake (pause: held until lifted). acquire.lua and acquire_one.lua read them first.
--
-- KEYS[1]  holds     HASH field -> until (us, Redis clock); field = the limit's encoded name
--                    (the whole limit) or name ':' encoded key (one key of it)
-- ARGV[1]  now_us    '' = read Redis TIME (always, outside tests)
-- ARGV[2]  field
-- ARGV[3]  for_us    hold this long from now; '' = lift the hold of this field
-- ARGV[4]  channel   optional: where a hold is announced (PUBLISH channel): a lifted one
--                    as ARGV[5] (tasks waiting for the limit look again at once), one
--                    placed as '!held ' .. ARGV[5] (a task admitted before it, about to
--                    run, must look again first)
-- ARGV[5]  name      the limit's name (the message)
--
-- A hold only ever lengthens: a shorter one (a later 429 with a shorter Retry-After) leaves
-- a longer one (a pause) in place; only lifting removes it. The hash has no TTL (a pause
-- lasts until lifted); each call sweeps the holds that have ended, so it stays as small as
-- the set of live holds. Returns the us until the field's hold ends ('0' when lifted).

local now = clock_us(ARGV[1])
local field = ARGV[2]
local ended = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) <= now then
    ended[#ended + 1] = all[i]
  end
end
-- In batches: unpack() has a limit (about 8000 values).
for i = 1, #ended, 1000 do
  redis.call('HDEL', KEYS[1], unpack(ended, i, math.min(i + 999, #ended)))
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], field)
  if ARGV[4] and ARGV[4] ~= '' then
    redis.call('PUBLISH', ARGV[4], ARGV[5] or '')
  end
  return '0'
end
local until_us = now + tonumber(ARGV[3])
local current = tonumber(redis.call('HGET', KEYS[1], field))
if current and current > until_us then
  until_us = current
else
  redis.call('HSET', KEYS[1], field, until_us)
  if ARGV[4] and ARGV[4] ~= '' then
    redis.call('PUBLISH', ARGV[4], '!held ' .. (ARGV[5] or ''))
  end
end
return string.format('%d', until_us - now)
