-- adapt.lua: what the upstream's answers teach about a limit it does not announce.
--
-- One state per limit (and key), updated by every worker that sees an answer: refusals
-- are counted (to tell a refusal that persists from one explained by jitter) and, for an
-- adaptive limit, lower the learned rate once per refusal episode; successes let it probe
-- back up, CUBIC-style; a rate the upstream states replaces it.
--
-- KEYS[1]  state     HASH: r = learned rate (per s), m = the rate at the last decrease (per
--                    s), p = probing time since then (us), s = the last success (us),
--                    e = the end of the refusal episode (us), w = the start of the refusal
--                    count's window (us), c = refusals counted in it
-- ARGV[1]  now_us    '' = read Redis TIME (always, outside tests)
-- ARGV[2]  event     'refuse' | 'success' | 'state' | 'read'
-- ARGV[3]  ceiling   the limit's rate in force (per s): the learned rate never exceeds it
-- ARGV[4]  adaptive  '1': learn the rate; '0': count refusals only
-- ARGV[5]  floor     per s: the learned rate never goes below it
-- ARGV[6]  decrease  the factor (0 < f < 1) a refusal episode multiplies the rate by
-- ARGV[7]  recover_us  probing time to climb back to the rate of the last decrease
-- ARGV[8]  episode_us  refusals this long after a decrease are the same episode
-- ARGV[9]  persist_count  this many refusals ...
-- ARGV[10] persist_us     ... within this long: the refusals persist
-- ARGV[11] stated    the upstream's stated rate (per s) for 'state'; '' otherwise
-- ARGV[12] ttl_ms    the state is forgotten this long after its last write
--
-- The rate probes up as CUBIC's window does (RFC 9438), on probing time p (time with
-- successes, gaps longer than a second counted as one: an idle fleet learns nothing):
--   rate = m * (1 - (1 - decrease) * (1 - p / recover)^3)
-- from m * decrease just after a decrease, flat near m (the rate that was refused), then
-- ever faster above it (the upstream may have raised its limit). Clamped to
-- [floor, ceiling]; without a state the rate is the ceiling.
--
-- Returns '<rate> <decreased> <persist> <count>': the learned rate (per s, '%.6f'; the
-- ceiling for a limit that is not adaptive), 1 if this call decreased it, 1 if the
-- refusals persist (count >= persist_count within persist_us), the refusals in the window.

local now = clock_us(ARGV[1])
local event = ARGV[2]
local ceiling = tonumber(ARGV[3])
local adaptive = ARGV[4] == '1'
local floor = math.min(tonumber(ARGV[5]), ceiling)
local decrease = tonumber(ARGV[6])
local recover_us = tonumber(ARGV[7])
local episode_us = tonumber(ARGV[8])
local persist_count = tonumber(ARGV[9])
local persist_us = tonumber(ARGV[10])
local GAP_US = 1000000

local st = redis.call('HMGET', KEYS[1], 'm', 'p', 's', 'e', 'w', 'c')
local m, p, s, e = tonumber(st[1]), tonumber(st[2]) or 0, tonumber(st[3]), tonumber(st[4])
local w, c = tonumber(st[5]), tonumber(st[6]) or 0

local function clamp(rate)
  return math.max(floor, math.min(ceiling, rate))
end

local function learned()
  if not adaptive or not m then
    return ceiling
  end
  local x = 1 - p / recover_us
  return clamp(m * (1 - (1 - decrease) * x * x * x))
end

local decreased, persist = 0, 0
local rate = learned()
local writes = nil

if event == 'refuse' then
  if not w or now - w > persist_us then
    w, c = now, 0
  end
  c = c + 1
  if c >= persist_count then
    persist = 1
  end
  writes = {'w', w, 'c', c}
  if adaptive and (not e or now >= e) then
    m = rate
    p = 0
    e = now + episode_us
    s = e
    rate = clamp(m * decrease)
    decreased = 1
    for _, v in ipairs({'m', m, 'p', p, 'e', e, 's', s}) do
      writes[#writes + 1] = v
    end
  end
elseif event == 'success' and adaptive and m then
  if now >= (e or 0) then
    local gap = now - (s or now)
    if gap > 0 then
      p = p + math.min(gap, GAP_US)
      rate = learned()
    end
    s = now
    writes = {'p', p, 's', s}
  end
elseif event == 'state' and adaptive then
  m = clamp(tonumber(ARGV[11]))
  p = recover_us
  s = now
  e = now
  rate = m
  writes = {'m', m, 'p', p, 's', s, 'e', e}
end

if writes then
  if adaptive then
    writes[#writes + 1] = 'r'
    writes[#writes + 1] = rate
  end
  redis.call('HSET', KEYS[1], unpack(writes))
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[12]))
end
return string.format('%.6f %d %d %d', rate, decreased, persist, c)
