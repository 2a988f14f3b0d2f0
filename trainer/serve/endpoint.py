"""A client's wait for a serve job: its /health answers 200 once the engine is up (the `ask`
client and the load generator both wait on it)."""

import time
import urllib.request


def wait_healthy(endpoint: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(endpoint + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {endpoint}/health did not answer within {seconds:.0f} s")
        time.sleep(1.0)
