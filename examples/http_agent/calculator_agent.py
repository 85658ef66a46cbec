"""A tool-calling calculator agent on GSM8K-style problems, written against the official `openai`
client only, trained by sat-jax through sat-serve's HTTP sessions (README "Agents over HTTP").

    sat-train --config configs/http_agent_gsm8k.yaml            # starts sat-serve with HTTP on
    python examples/http_agent/calculator_agent.py --url http://127.0.0.1:8800 --workers 8

Each worker asks the server for an admitted session (`POST /sessions`: the prompt and a session
id), plays it as any OpenAI agent would, with `base_url` at the session's endpoint, and ends it
(`POST /sessions/{id}/end`; no reward: the server's `task.reward` scores the last reply), or
discards it (`{"discard": true}`) when it failed for a reason that is not the policy's. The
server records every generated token's behavior log-prob, version and routing, masks what the
agent inserted (tool results), and hands the finished group to the trainer. A worker never dies
of an error: timeouts are retried (a session answers a retry with the reply it already gave),
sessions the server ended are left, anything else is discarded.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from typing import Any

import openai

from sat_jax.tasks.envs.calculator import CALCULATOR_TOOL
from sat_jax.tasks.envs.expression import calculate

SYSTEM = 'Use the calculator tool for arithmetic. Put the final answer after "####".'
log = logging.getLogger("calculator_agent")


def run_tool(arguments: str) -> str:
    """The calculator's answer to one call's JSON arguments ("error: ..." for a bad call)."""
    try:
        expression = json.loads(arguments)["expression"]
    except (ValueError, KeyError, TypeError):
        return 'error: calculator needs arguments {"expression": "..."}'
    return calculate(expression)


def play(
    client: openai.OpenAI, question: str, *, model: str = "", max_turns: int = 4
) -> list[dict[str, Any]]:
    """One episode: the model answers, calling the calculator as often as it likes (at most
    `max_turns` replies). `client` points at the session (`.../sessions/{id}/v1`); `model` is
    the served model's name (asked of the server when "")."""
    model = model or client.models.list().data[0].id
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR_TOOL]
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            content = run_tool(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return messages


def finish(server: openai.OpenAI, sid: str, *, discard: bool) -> None:
    """Ends the session (scored by the server's reward), or discards it (its sample is offered
    again and nothing trains on it). An end is idempotent, so a lost reply is simply resent; a
    session the server already ended (409, 404: reaped while idle) needs nothing more."""
    body = {"discard": True} if discard else {}
    try:
        server.post(f"/sessions/{sid}/end", body=body, cast_to=object)
    except (openai.ConflictError, openai.NotFoundError) as e:
        log.info("session %s was already ended: %s", sid, e.message)
    except openai.OpenAIError as e:
        log.warning("ending session %s failed (%s); the server reaps it", sid, e)


def play_session(server: openai.OpenAI, url: str, session: dict[str, Any]) -> None:
    """Plays one taken session and ends it, whatever happens: a request the policy made
    impossible (400: the token budget is spent) ends it as it stands; a session the server ended
    (409 session_ended, 404) needs no end; any other failure (the network, the server) discards
    it, since it is not the policy's. Timeouts are retried by the client: a retry of a request
    the server already answered gets that answer, not a second turn."""
    sid = session["session_id"]
    client = server.with_options(base_url=f"{url}/sessions/{sid}/v1")
    try:
        play(client, session["prompt"]["text"])
    except openai.BadRequestError as e:  # e.g. the session's token budget is spent
        log.info("session %s ended early: %s", sid, e.message)
    except (openai.ConflictError, openai.NotFoundError) as e:
        if e.code in ("session_ended", "session_not_found"):
            log.info("session %s was ended by the server: %s", sid, e.message)
            return
        log.warning("session %s: %s; discarded", sid, e.message)
        finish(server, sid, discard=True)
        return
    except openai.OpenAIError as e:
        log.warning("session %s failed (%s); discarded", sid, e)
        finish(server, sid, discard=True)
        return
    finish(server, sid, discard=False)


def worker(url: str, token: str, stop: threading.Event, done: list[int]) -> None:
    """Takes sessions one at a time and plays them until `stop`; never dies of an error."""
    server = openai.OpenAI(base_url=url, api_key=token or "none", max_retries=2, timeout=600)
    while not stop.is_set():
        try:
            taken = server.post(
                "/sessions", body={"max_sessions": 1, "timeout_s": 5}, cast_to=object
            )
        except openai.OpenAIError as e:  # 429 (all sessions open), the server restarting...
            log.info("taking a session failed: %s", e)
            stop.wait(1.0)
            continue
        for session in taken["sessions"]:
            play_session(server, url, session)
            done.append(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8800", help="sat-serve's HTTP address")
    parser.add_argument("--token", default="", help="server.token, if the server has one")
    parser.add_argument("--workers", type=int, default=8, help="sessions played at once")
    parser.add_argument("--sessions", type=int, default=0, help="stop after this many (0 = never)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    stop, done = threading.Event(), []
    threads = [
        threading.Thread(target=worker, args=(args.url, args.token, stop, done), daemon=True)
        for _ in range(args.workers)
    ]
    for t in threads:
        t.start()
    try:
        while not stop.wait(1.0):
            if args.sessions and len(done) >= args.sessions:
                stop.set()
    except KeyboardInterrupt:
        stop.set()
    for t in threads:
        t.join(timeout=30)
    log.info("%d sessions played", len(done))


if __name__ == "__main__":
    main()
