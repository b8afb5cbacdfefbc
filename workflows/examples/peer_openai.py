"""The PEER loop with the plain OpenAI Python SDK: the kvflow metadata goes in `extra_body`.

    python workflows/examples/peer_openai.py --url http://127.0.0.1:8000

This is all a client needs: register the workflow once (POST /v1/workflows, or send it inline as
`kvflow.workflow_spec` with the first call), send each agent's fixed prompt as the system message
with {"kvflow": {"client_id", "workflow", "agent"}}, and finish the instance at the end.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
import uuid
from pathlib import Path

import yaml
from openai import OpenAI


def post(url: str, key: str | None, body: dict) -> None:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    urllib.request.urlopen(urllib.request.Request(url, json.dumps(body).encode(), headers), timeout=60).read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", default=None)
    args = parser.parse_args()

    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "peer.yaml").read_text())
    base = args.url.rstrip("/") + "/v1"
    post(base + "/workflows", args.key, spec)
    client_id = f"peer-{uuid.uuid4().hex[:8]}"
    # the session header keeps this client's calls on one ingress replica
    client = OpenAI(base_url=base, api_key=args.key or "none", default_headers={"x-session-id": client_id})
    message = "What was the year-over-year change in free cash flow?"
    for agent in ("planner", "executor", "expresser", "reviewer"):
        reply = client.chat.completions.create(
            model="default", max_tokens=24,
            messages=[{"role": "system", "content": spec["agents"][agent]["prompt"]},
                      {"role": "user", "content": message}],
            extra_body={"kvflow": {"client_id": client_id, "workflow": "peer", "agent": agent}})
        cached = reply.usage.prompt_tokens_details.cached_tokens if reply.usage.prompt_tokens_details else 0
        print(f"{agent:>9}: {reply.usage.prompt_tokens} prompt tokens, {cached} cached")
        message = reply.choices[0].message.content or ""
    post(f"{base}/clients/{client_id}/finish", args.key, {})


if __name__ == "__main__":
    main()
