"""The OpenAI-compatible backends ``hetserve route`` fronts: who they are, whether they are up, and
which one takes the next request.

A ``Backend`` is one replica's endpoint with its role and its share of requests. ``BackendPool``
keeps their state (in-flight requests, health) and makes the two decisions, each with a policy from
``hetserve.policies`` fed ``ReplicaState`` snapshots, as the simulator and ``hetserve serve`` do:

* ``pick_entry``: the backend a new request goes to first (colocated, or prefill under P/D):
  ``weights`` = the plan's flow weights, smooth weighted round robin (``routing.FlowWeighted``);
  any placement name (``jsq``, ``rr``, ``lot``, ``po2``) = that placement policy;
* ``pick_decode``: the decode backend for a prefill one, by the plan's KV-route weights
  (``FlowWeighted`` keyed by the prefill backend).

Both skip backends that are marked down or were already tried for this request. A backend is
marked down by a failed request or a failed health check, and up again by a passing health check.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hetserve.errors import SpecError
from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.policies.placement import make_placement
from hetserve.policies.routing import FlowWeighted

ENTRY_POLICIES = ("weights", "jsq", "rr", "lot", "po2")
# a deploy.json's top-level fields (export.bundle.Bundle.deploy_dict, an exporter's extras included)
DEPLOY_FIELDS = frozenset({"engine", "engine_version", "plan", "replicas", "router", "machines", "shared", "cluster"})
log = logging.getLogger(__name__)


@dataclass
class Backend:
    id: str
    role: str  # "colocated", "prefill" or "decode"
    url: str  # base URL, no trailing slash: http://host:port
    weight: float = 1.0
    alive: bool = True
    in_flight: int = 0

    def state(self) -> ReplicaState:
        return ReplicaState(self.id, self.role, 0, self.in_flight, 0, float(self.in_flight), 0, 0, 0,
                            alive=self.alive)


@dataclass(frozen=True)
class RouteConfig:
    backends: tuple[Backend, ...]
    kv_routes: tuple[tuple[str, str, float], ...] = ()
    protocol: str = "openai"  # or "vllm-disaggregated-proxy"

    @property
    def disaggregated(self) -> bool:
        return any(b.role == "prefill" for b in self.backends)


def config_from_deploy(path: str | Path) -> RouteConfig:
    """Backends, weights and KV routes from a bundle's ``deploy.json`` (``hetserve export``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise SpecError(str(path), "(file)", "a readable deploy.json", exc.strerror or str(exc)) from exc
    except json.JSONDecodeError as exc:
        raise SpecError(str(path), "(file)", "JSON", f"line {exc.lineno}: {exc.msg}") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), "(file)", "UTF-8 JSON text", f"byte {exc.start} is not UTF-8") from exc
    if not isinstance(data, dict):
        raise SpecError(str(path), "(file)", "a JSON object (a bundle's deploy.json)", type(data).__name__)
    unknown = sorted(set(data) - DEPLOY_FIELDS)
    if "replicas" not in data:
        named = (f"; the file has unknown field(s) {', '.join(repr(k) for k in unknown)}: route reads "
                 "'replicas' and 'router'" if unknown else "")
        raise SpecError(str(path), "replicas", "a non-empty list of replicas, each {id, role, endpoint} (the "
                        f"field is missing{named})")
    if not isinstance(data["replicas"], list) or not data["replicas"]:
        got = data["replicas"] if isinstance(data["replicas"], list) else type(data["replicas"]).__name__
        raise SpecError(str(path), "replicas", "a non-empty list of replicas, each {id, role, endpoint}", got)
    if data.get("engine") == "hetserve":  # its replicas are one server's, behind the one endpoint
        router = data.get("router") if isinstance(data.get("router"), dict) else {}
        at = f", {router['endpoint']}" if isinstance(router.get("endpoint"), str) else ""
        raise SpecError(str(path), "engine", "a vLLM or SGLang bundle's deploy.json (hetserve's own server routes "
                        f"between its replicas itself: point clients at it{at})", "hetserve")
    # an engine export never writes (a typo, another tool's file) is no bundle route knows how to
    # front: refused, not read as if it were vLLM's or SGLang's. A file without the field is read.
    if "engine" in data:
        from hetserve.export import ENGINES

        routed = [e for e in ENGINES if e != "hetserve"]
        if data["engine"] not in routed:
            raise SpecError(str(path), "engine", f"{' or '.join(routed)} (the engines of hetserve export --to whose "
                            "bundles route fronts; a hetserve bundle routes itself)",
                            "null" if data["engine"] is None else data["engine"])
    router = data.get("router") or {}
    if not isinstance(router, dict):
        raise SpecError(str(path), "router", "an object {weights, kv_routes}", type(router).__name__)
    weights = router.get("weights") or {}
    if not isinstance(weights, dict):
        raise SpecError(str(path), "router.weights", "an object mapping each entry replica's id to its share",
                        type(weights).__name__)
    backends = []
    for i, r in enumerate(data["replicas"]):
        for key in ("id", "role", "endpoint"):
            if not isinstance(r, dict) or not isinstance(r.get(key), str) or not r[key].strip():
                raise SpecError(str(path), f"replicas.{i}.{key}", "a non-empty string",
                                repr(r.get(key)) if isinstance(r, dict) else r)
        if r["role"] not in ("prefill", "decode", "colocated"):
            raise SpecError(str(path), f"replicas.{i}.role", "prefill, decode or colocated", r["role"])
        check_url(r["endpoint"], str(path), f"replicas.{i}.endpoint")
        if any(b.id == r["id"] for b in backends):
            raise SpecError(str(path), f"replicas.{i}.id", "an id no other replica has", r["id"])
        same = [b.id for b in backends if b.url == r["endpoint"].rstrip("/")]
        if same:  # two replicas on one server would be one backend counted twice (P/D with itself)
            raise SpecError(str(path), f"replicas.{i}.endpoint", f"an endpoint no other replica has ({same[0]} has it)",
                            r["endpoint"])
        w = weights.get(r["id"], 1.0) if isinstance(weights, dict) else None
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
            raise SpecError(str(path), f"router.weights.{r['id']}", "a non-negative number", repr(w))
        backends.append(Backend(r["id"], r["role"], r["endpoint"].rstrip("/"), float(w)))
    check_weights(str(path), weights, backends)
    routes = kv_routes_of(str(path), router.get("kv_routes") or [], {b.id: b.role for b in backends})
    roles = {b.role for b in backends}
    if not roles & {"prefill", "colocated"}:
        raise SpecError(str(path), "replicas", "a prefill or colocated replica to take requests", "decode only")
    if "prefill" in roles and "decode" not in roles:
        raise SpecError(str(path), "replicas", "a decode replica for the prefill ones to hand off to", "none")
    if unknown:  # a typo'd field would be dropped unseen: said, though the file serves
        log.warning("%s: unknown field(s) %s ignored (a deploy.json has %s)", path, ", ".join(map(repr, unknown)),
                    ", ".join(sorted(DEPLOY_FIELDS)))
    return RouteConfig(tuple(backends), tuple(routes), str(router.get("protocol", "openai")))


def check_weights(where: str, weights, backends: list[Backend]) -> None:
    """``router.weights`` (the share of requests each entry replica takes), where given: one for every
    prefill or colocated replica and for no other, not all zero (a replica left out would silently
    take the default share, 1)."""
    if not isinstance(weights, dict) or not weights:
        return
    entry = [b.id for b in backends if b.role in ("prefill", "colocated")]
    for k in weights:
        if k not in entry:
            raise SpecError(where, f"router.weights.{k}", "the id of a prefill or colocated replica "
                            f"({', '.join(entry)})", k)
    missing = [b for b in entry if b not in weights]
    if missing:
        raise SpecError(where, "router.weights", "a weight for every prefill or colocated replica",
                        f"none for {', '.join(missing)}")
    if not any(weights[b] > 0 for b in entry):
        raise SpecError(where, "router.weights", "at least one weight above 0", weights)


def kv_routes_of(where: str, items, roles: dict[str, str]) -> list[tuple[str, str, float]]:
    """``router.kv_routes``: each from a prefill replica to a decode replica, with a weight of 0 or
    more (a route to another kind of replica would hand the decode half of a request to it)."""
    if not isinstance(items, list):
        raise SpecError(where, "router.kv_routes", "a list of {from, to, weight}", type(items).__name__)
    routes = []
    for i, k in enumerate(items):
        if not isinstance(k, dict) or not {"from", "to", "weight"} <= set(k):
            raise SpecError(where, f"router.kv_routes.{i}", "{from, to, weight}", k)
        for end, role in (("from", "prefill"), ("to", "decode")):
            if not isinstance(k[end], str) or roles.get(k[end]) != role:
                ids = ", ".join(r for r, x in roles.items() if x == role) or "none"
                raise SpecError(where, f"router.kv_routes.{i}.{end}", f"the id of a {role} replica ({ids})", k[end])
        w = k["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
            raise SpecError(where, f"router.kv_routes.{i}.weight", "a number, 0 or more", repr(w))
        routes.append((k["from"], k["to"], float(w)))
    return routes


def check_url(url: str, where: str, field: str) -> None:
    """A backend's base URL: http(s), a host, a port in range when one is given (a port past 65535
    would fail every request, not the start), and no path, query or fragment: route appends
    /v1/completions, /health ... itself, so ``http://h:8000/v1`` (the URL ``serve``'s banner names)
    would send every probe to /v1/health and take the backend out."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError past 65535 or when not a number
    except ValueError:
        ok = False
    if not ok:
        raise SpecError(where, field, "an http(s)://host[:port] URL, port 0-65535", url)
    if parts.username is not None or parts.password is not None:  # never echo the secret back
        raise SpecError(where, field, "a URL without user:password@ (it would be printed and logged; backends "
                        "take route's --backend-api-key-file)", f"{parts.scheme}://***@{parts.hostname}")
    if parts.path.rstrip("/") or parts.query or parts.fragment:
        extra = parts.path.rstrip("/") or ("?" + parts.query if parts.query else "#" + parts.fragment)
        raise SpecError(where, field, f"an http(s)://host[:port] URL without a path (drop {extra}: route adds "
                        "/v1/... itself)", url)


def config_from_backends_option(text: str) -> RouteConfig:
    """``--backends URL,URL``: every comma-separated entry a URL (an empty one, ``a,,b`` or a
    trailing comma, is a typo that would silently drop a backend, so it is refused)."""
    urls = [u.strip() for u in text.split(",")]
    if not any(urls):
        raise SpecError("--backends", SpecError.OPTION, "one or more backend URLs separated by commas", text)
    for i, u in enumerate(urls):
        if not u:
            raise SpecError("--backends", SpecError.OPTION, f"a URL at every position (entry {i} is empty)", text)
    return config_from_urls(urls)


def config_from_urls(urls: Sequence[str]) -> RouteConfig:
    """Colocated backends given by URL (``--backends``), equal weights."""
    out = []
    for i, u in enumerate(urls):
        check_url(u, "--backends", f"{i}")
        if any(b.url == u.rstrip("/") for b in out):
            raise SpecError("--backends", f"{i}", "each backend once", u)
        out.append(Backend(f"b{i}", "colocated", u.rstrip("/")))
    return RouteConfig(tuple(out))


class BackendPool:
    """State of the backends and the two decisions (module docstring)."""

    def __init__(self, config: RouteConfig, policy: str = "weights", seed: int = 0):
        if policy not in ENTRY_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ENTRY_POLICIES)}, got {policy!r}")
        self.config = config
        self.by_id = {b.id: b for b in config.backends}
        self.entry = [b for b in config.backends if b.role in ("prefill", "colocated")]
        self.decode = [b for b in config.backends if b.role == "decode"]
        self._weighted = FlowWeighted()
        self._placement = None if policy == "weights" else make_placement(policy)
        self._kv = {}
        for src, dst, w in config.kv_routes:
            self._kv.setdefault(src, []).append((dst, w))
        self._seq = 0

    def _request(self) -> RequestInfo:
        self._seq += 1
        return RequestInfo(self._seq, 0.0, 0, 0.0)

    def pick_entry(self, exclude: set[str]) -> Backend | None:
        live = [b for b in self.entry if b.alive and b.id not in exclude]
        if not live:
            return None
        if self._placement is None:
            return self.by_id[self._weighted.choose(self._request(), "", [(b.state(), b.weight) for b in live], 0.0)]
        return self.by_id[self._placement.choose(self._request(), [b.state() for b in live], 0.0)]

    def pick_decode(self, prefill: str, exclude: set[str]) -> Backend | None:
        routes = dict(self._kv.get(prefill, ())) or {b.id: 1.0 for b in self.decode}
        live = [(self.by_id[d].state(), w) for d, w in routes.items()
                if d in self.by_id and self.by_id[d].alive and d not in exclude]
        if not live:  # the plan's routes from this prefill are all down: any live decode backend
            live = [(b.state(), 1.0) for b in self.decode if b.alive and b.id not in exclude]
        if not live:
            return None
        return self.by_id[self._weighted.choose(self._request(), prefill, live, 0.0)]
