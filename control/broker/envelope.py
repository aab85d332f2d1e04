"""The Celery task message of a job, as kombu's Redis transport stores it: the one
place that knows kombu's envelope (the gateway pushes it itself; replicas read it
back). tests/broker/test_messages.py checks it against what `send_task` pushes.

The scripts that look into a message inside the broker (admission marks one behind,
RESCUE finds which attempts are queued and since when) use `ENVELOPE_LUA`, kept here
next to the Python that writes and reads the envelope: reading it in Python instead
would cost RESCUE a round trip and a copy of whole queues, and admission its one call."""

from __future__ import annotations

import base64
import json

import orjson
from celery import Celery

from control.core import protocol as p

# The headers a consumer reads: Celery's consumer finds a message's strategy by `task`
# (protocol 2), and `id` names it. The others `send_task` writes (eta, expires, retries,
# time limits, group, stamps, origin ..., mostly null) and the body's embedded
# callbacks serve Celery's own task Request, which the replicas' strategy replaces
# (tasks/replica/worker.py): left out, they save a third of the message, which the
# gateway sends once per request and the broker keeps until the answer
# (docs/decisions/0023).
KEPT_HEADERS = ("lang", "task", "id")


class TaskMessages:
    """The message `send_task` would LPUSH for a job, as kombu's Redis transport stores it.

    Celery builds the task message (protocol 2) once, as a template; per request
    only the id, the argument and the routing change. The envelope is what
    kombu's virtual channel adds (`prepare_message` and `_inplace_augment_message`),
    with the body kept as JSON text (`body_encoding` None, which kombu reads as is)
    rather than base64, and of Celery's headers only `KEPT_HEADERS`. The gateway
    pushes it in the same Lua call that admits the request, which saves the publish
    round trip and most of `send_task`'s cost per request.
    tests/system/test_serving.py runs it through a real worker.
    """

    def __init__(self, app: Celery) -> None:
        template = app.amqp.as_task_v2(
            "-", p.TASK_NAME, args=[], kwargs={}, argsrepr="", kwargsrepr="{}", ignore_result=True
        )
        self._headers = {k: v for k, v in template.headers.items() if k in KEPT_HEADERS}
        # No answer travels back through Celery (the gateway's reply list carries it), so
        # the template's empty reply queue is left out.
        self._properties = {k: v for k, v in template.properties.items() if k != "reply_to"}
        _args, kwargs, _embed = template.body
        self._body_tail = f", {json.dumps(kwargs)}, {{}}]"

    def __call__(self, job: p.Job) -> str:
        headers = {**self._headers, "id": job.id}
        properties = {
            **self._properties,
            "correlation_id": job.id,
            "delivery_info": {"exchange": "", "routing_key": p.queue_name(job.model)},
            "priority": p.priority_of(job.tier) + (p.BEHIND_STEP if job.behind else 0),
            "body_encoding": None,
            "delivery_tag": job.id,  # unique while in flight; no acks are tracked (no_ack queues)
            "delivery_mode": 2,  # as send_task marks it (persistent); the Redis transport keeps it as is
        }
        envelope = {  # the properties first: `behind` finds the priority before any text
            "properties": properties,
            # The job's fields at their defaults are left out: the replica's parse restores them.
            "body": f"[[{job.model_dump_json(exclude={'behind'}, exclude_defaults=True)}]{self._body_tail}",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
        }
        return orjson.dumps(envelope).decode()


def job_from_message(raw: bytes | str) -> p.Job:
    """The job inside a message as `TaskMessages` (or `send_task`) stored it."""
    envelope = json.loads(raw)
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = json.loads(body)
    job = p.Job.model_validate(args[0])
    job.behind = p.is_behind(envelope["properties"].get("priority"))
    return job


# The Lua side of the envelope, for the scripts of control/broker/scripts.py.
ENVELOPE_LUA = """
-- The message of a request queued behind other tenants' ones: its priority moved by
-- `behind_step` (the properties come first, so the first "priority" is theirs).
local function envelope_behind(message, step, behind_step)
  local from = '"priority":' .. step
  local at = string.find(message, from, 1, true)
  if not at then return message end
  return message:sub(1, at - 1) .. '"priority":' .. (step + behind_step) .. message:sub(at + #from)
end

-- The attempt a message carries (its correlation id), or nil.
local function envelope_attempt(raw)
  return string.match(raw, '"correlation_id":"([^"]+)"')
end

-- When the job in a message was received (ms), or -1 when it cannot be read.
local function envelope_received_ms(raw)
  local ok, env = pcall(cjson.decode, raw)
  if ok and type(env) == 'table' and type(env.body) == 'string' then
    local ok2, body = pcall(cjson.decode, env.body)
    if ok2 and type(body) == 'table' and type(body[1]) == 'table' and type(body[1][1]) == 'table' then
      return tonumber(body[1][1].received_ms) or -1
    end
  end
  return -1
end
"""
