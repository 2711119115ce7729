-- Argo CD health check for kvpilot.dev/InferenceModel (Lua 5.1, as Argo CD runs it).
-- It reads the conditions the kvpilot operator writes (operator/status.py):
--   Degraded=True                                    -> Degraded    (invalid spec, OOMKilled, CrashLoopBackOff,
--                                                                     ImagePullBackOff, rollout past its deadline)
--   Ready=False, reason ScaledToZero                 -> Suspended   (replicas is 0 on purpose)
--   Ready=False, reason RoleScaledToZero             -> Suspended   (a disaggregated model with one role at
--                                                                     0 replicas on purpose: it needs both roles)
--   Ready=True and ScalingLimited=True               -> Healthy     (serving; more replicas wanted than fit)
--   Ready=True and Progressing=True                  -> Progressing (rolling out or scaling)
--   Ready=True                                       -> Healthy
--   no status yet, an unobserved generation, or not
--   Ready for any other reason (loading, Pending)    -> Progressing
-- Argo CD itself reports Missing when the object does not exist, so this script never needs to.
local hs = {}

local function find_condition(conditions, ctype)
  if conditions == nil then
    return nil
  end
  for _, c in ipairs(conditions) do
    if c.type == ctype then
      return c
    end
  end
  return nil
end

local function describe(c)
  local reason = c.reason or c.type
  if c.message ~= nil and c.message ~= "" then
    return reason .. ": " .. c.message
  end
  return reason
end

local status = obj.status
if status == nil or status.conditions == nil or #status.conditions == 0 then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvpilot operator to report status"
  return hs
end

local generation = obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvpilot operator to observe generation " .. generation
  return hs
end

local degraded = find_condition(status.conditions, "Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded)
  return hs
end

local ready = find_condition(status.conditions, "Ready")
local progressing = find_condition(status.conditions, "Progressing")
local limited = find_condition(status.conditions, "ScalingLimited")

-- A disaggregated model (spec.disaggregation) is Ready only while both roles serve (operator/rolestatus.py);
-- its conditions already combine the roles, so nothing here reads status.roles.
if ready ~= nil and ready.status == "False" and (ready.reason == "ScaledToZero" or ready.reason == "RoleScaledToZero") then
  hs.status = "Suspended"
  hs.message = describe(ready)
  return hs
end

if ready ~= nil and ready.status == "True" then
  if limited ~= nil and limited.status == "True" then
    hs.status = "Healthy"
    hs.message = describe(ready) .. "; " .. describe(limited)
    return hs
  end
  if progressing ~= nil and progressing.status == "True" then
    hs.status = "Progressing"
    hs.message = describe(progressing)
    return hs
  end
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = describe(ready)
else
  hs.message = "Waiting for the Ready condition"
end
if limited ~= nil and limited.status == "True" then
  hs.message = hs.message .. "; " .. describe(limited)
end
return hs
