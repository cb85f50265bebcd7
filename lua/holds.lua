-- holds.lua: read the live holds of a namespace, on the clock of the Redis that keeps them.
--
-- A script rather than a pipeline of TIME and HGETALL: in a Redis Cluster TIME has no key,
-- so a client sends it to some node, whose clock need not be the one the holds were written
-- with (hold.lua and the acquire scripts read TIME on the master of the namespace's slot);
-- and redis-py refuses TIME in a cluster pipeline. Here both come from that one master.
-- Reads only: the ended holds are swept by hold.lua.
--
-- KEYS[1]  holds     HASH field -> until (us, Redis clock), as written by hold.lua
-- ARGV[1]  now_us    '' = read Redis TIME (always, outside tests)
--
-- Returns {now_us, field, until_us, field, until_us, ...} (all strings), live holds only.

local now = clock_us(ARGV[1])
local out = {string.format('%d', now)}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) > now then
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
