-- purge_parked.lua: delete parked tasks for good (`celery throttle purge`).
--
-- KEYS[1..6]  due, messages, claimed, pub, ids, tasks (as for commit_parked.lua)
-- ARGV        tokens
--
-- Only a token still waiting in `due` is deleted: one a releaser has claimed (it may be
-- publishing it now) is left alone, and will run. Atomic with the releasers' claims, so a
-- task is either released or purged, never both, never lost half-way. Returns the number
-- deleted.

local done = 0
for i = 1, #ARGV do
  local token = ARGV[i]
  if redis.call('ZREM', KEYS[1], token) == 1 then
    redis.call('HDEL', KEYS[2], token)
    redis.call('HDEL', KEYS[4], token)
    local task = redis.call('HGET', KEYS[6], token)
    if task then
      if redis.call('HGET', KEYS[5], task) == token then
        redis.call('HDEL', KEYS[5], task)
      end
      redis.call('HDEL', KEYS[6], token)
    end
    done = done + 1
  end
end
return done
