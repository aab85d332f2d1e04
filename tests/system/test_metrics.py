"""/metrics in the style of vLLM, TGI and Triton, and the figure none of them reports:
the model's work spent for clients that had gone."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.support.deploy import FREE_KEY, MODEL, Deployment, deployment
from tests.support.waiting import until

BUDGET = {"X-Deadline-Ms": "5000"}


def _sum(d: Deployment, name: str, text: str | None = None) -> float:
    """The sum of every series of `name` (whatever their labels), in one scrape."""
    text = text if text is not None else requests.get(f"{d.url}/metrics", timeout=5).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if not line.startswith("#") and (line.startswith(name + "{") or line.startswith(name + " "))
    )


def _families(d: Deployment) -> set[str]:
    text = requests.get(f"{d.url}/metrics", timeout=5).text
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}


def test_metrics_count_requests_times_and_the_work_spent_for_clients_that_went() -> None:
    with deployment(workers=1, policy="continuous", BATCH_MS="1000", MAX_BATCH="4") as d:
        assert d.post(**BUDGET).status_code == 200
        streamed = d.post({"model": MODEL, "prompt": "def g():\n", "stream": True}, **BUDGET)
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        families = _families(d)
        for family in (
            "keybatch_requests",
            "keybatch_e2e_request_latency_seconds",
            "keybatch_request_queue_time_seconds",
            "keybatch_time_to_first_token_seconds",
            "keybatch_num_requests_waiting",
            "keybatch_oldest_waiting_seconds",
            "keybatch_num_requests_running",
            "keybatch_batch_current_size",
            "keybatch_batch_duration_seconds",
            "keybatch_replica_utilization",
            "keybatch_wasted_slots",
            "keybatch_wasted_model_seconds",
        ):
            assert family in families or f"{family}_total" in families, family
        assert _sum(d, "keybatch_e2e_request_latency_seconds_count") >= 1
        assert _sum(d, "keybatch_wasted_slots_total") == 0

        # A request cancelled 300 ms into its 1,000 ms run leaves at the next step: one slot
        # and about 0.3 s of the model spent for nobody.
        pool = ThreadPoolExecutor(1)
        running = pool.submit(d.post, {"model": MODEL, "prompt": "def f():\n"}, **BUDGET, **{"X-Request-Id": "gone-1"})
        assert until(lambda: _sum(d, "keybatch_num_requests_running") >= 1, 5)
        time.sleep(0.3)  # how long it runs before the client gives up: the quantity measured
        cancel = requests.delete(f"{d.url}/v1/completions/gone-1", headers={"Authorization": f"Bearer {FREE_KEY}"})
        assert cancel.status_code in (200, 202, 204), cancel.text
        assert running.result(10).status_code == 409
        # Both read off one scrape: each gateway process has its own copy of the registry.
        scrapes: list[str] = []

        def counted() -> bool:
            scrapes.append(requests.get(f"{d.url}/metrics", timeout=5).text)
            return _sum(d, "keybatch_wasted_slots_total", scrapes[-1]) == 1

        assert until(counted, 5)
        spent = _sum(d, "keybatch_wasted_model_seconds_total", scrapes[-1])
        assert 0.2 < spent < 0.9, spent
