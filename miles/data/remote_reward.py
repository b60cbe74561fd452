"""The `remote` reward: one HTTP POST per batch to a scoring server (`task.reward_url`).

    request:  {"samples": [{"response": "...", "label": "...", "info": {"prompt": "..."}}, ...]}
    reply:    {"rewards": [1.0, 0.0, ...]}        # one number per sample, in order

An HTTP error, a timeout or a reply that is not this JSON scores the whole batch 0 (counted).
"""

from __future__ import annotations

import json
import urllib.request


def post_samples(url: str, timeout_s: float, responses: list[str], labels: list[str], infos: list[dict]) -> list:
    """The server's rewards for these samples; raises on any transport or protocol failure."""
    samples = [{"response": r, "label": label, "info": info} for r, label, info in zip(responses, labels, infos)]
    request = urllib.request.Request(url, data=json.dumps({"samples": samples}, default=str).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:  # raises HTTPError on 4xx / 5xx
        body = json.loads(reply.read())
    if not isinstance(body, dict) or not isinstance(body.get("rewards"), list):
        raise ValueError(f'{url} replied without a "rewards" list')
    return body["rewards"]
