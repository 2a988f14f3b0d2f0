"""The few calls of Prometheus's HTTP API that Kitchen's checks make (standard library only)."""

import json
import urllib.error
import urllib.parse
import urllib.request


class PrometheusError(RuntimeError):
    """Prometheus refused a request; the message is Prometheus's own (e.g. a parse error)."""


def api_get(url: str, path: str, params: dict | None = None, timeout_s: float = 10.0):
    """GET `url/path?params` and return the `data` field of Prometheus's JSON envelope."""
    full = url.rstrip("/") + path
    if params:
        full += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(full, timeout=timeout_s) as response:
            body = json.load(response)
    except urllib.error.HTTPError as err:  # 4xx/5xx still carry the JSON envelope
        try:
            body = json.load(err)
        except ValueError:
            raise PrometheusError(f"GET {path}: HTTP {err.code}") from err
    if body.get("status") != "success":
        raise PrometheusError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
    return body["data"]


def instant_query(url: str, expr: str) -> list[dict]:
    """The result of an instant query at now: a list of {"metric": {...}, "value": [t, "v"]}."""
    data = api_get(url, "/api/v1/query", {"query": expr})
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]


def format_query(url: str, expr: str) -> str:
    """Prometheus's canonical form of `expr`; raises PrometheusError if it does not parse."""
    return api_get(url, "/api/v1/format_query", {"query": expr})


def rules(url: str) -> list[dict]:
    """Every loaded rule: name, type ("recording"/"alerting"), health, lastError, ..."""
    groups = api_get(url, "/api/v1/rules")["groups"]
    return [rule for group in groups for rule in group["rules"]]
