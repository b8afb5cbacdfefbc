"""The PEER loop (Plan / Execute / Express / Review) through the kvflow-ray SDK.

    kvflow-ray serve &                       # or any kvflow-ray endpoint
    python workflows/examples/peer_sdk.py --url http://127.0.0.1:8000 --question "..."

Every agent call carries the kvflow metadata (client id, workflow, agent), so the server routes it
to the replica that holds the agent's prompt and keeps the next agent's prompt warm; leaving the
`with` block finishes the workflow instance. (With the random-weight CPU model the replies are
meaningless text; the serving path is real.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvflow_ray.client import Workflow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", default=None, help="bearer API key (when the server has keys)")
    parser.add_argument("--question", default="How did operating margin change between FY2023 and FY2024?")
    parser.add_argument("--rounds", type=int, default=2, help="plan-execute-express-review rounds")
    args = parser.parse_args()

    peer = Workflow.from_yaml(Path(__file__).resolve().parents[1] / "peer.yaml")
    with peer.client(base_url=args.url.rstrip("/") + "/v1", api_key=args.key) as run:
        feedback = ""
        for round_ in range(1, args.rounds + 1):
            plan = run.agent("planner").text([{"role": "user", "content": args.question + feedback}], max_tokens=32)
            work = run.agent("executor").text([{"role": "user", "content": f"Plan:\n{plan}"}], max_tokens=32)
            answer = run.agent("expresser").text([{"role": "user", "content": f"Working:\n{work}"}], max_tokens=32)
            review = run.agent("reviewer").text([{"role": "user", "content": f"Answer:\n{answer}"}], max_tokens=16)
            print(f"round {round_}: answer {answer!r}\n         review {review!r}")
            feedback = f"\nReviewer feedback: {review}"
    print(f"finished workflow instance {run.client_id}")


if __name__ == "__main__":
    main()
