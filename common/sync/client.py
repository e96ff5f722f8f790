"""The trainer-side client: ``update_weights`` for any engine, and the checks that need the learner.

One API for both engines; an engine plugs in a *transport* (``vllm_plugin.client`` for vLLM:
in-process ``LLM`` or a running ``vllm serve`` over HTTP, staging through ``transport.Stager``;
``sglang_plugin.client`` for SGLang, over ``bridge.BridgeTransport``).  A transport provides::

    rpc(method, *str_args) -> [result per rank]      the worker extension's grid_* methods
    stage(bucket) -> source dict; release(source)    move bytes (shm file, CUDA IPC, ...)
    send(bucket, source)  (optional)                  push the bytes while the load RPC runs
                                                      (e.g. an NCCL broadcast the workers receive)
    pause(); resume(); reset_prefix_cache()           generation control
    prompt_logprobs(prompts) -> (logprobs, cached)    for the probes (optional)

What ``update_weights`` takes (``common.sync.sources``): a state dict or ``(name, tensor)`` pairs
(zero-copy; transformers 5 fused experts split into per-expert views), a state dict of FSDP2
``DTensor`` shards (``ShardedSource``: gathered one bucket at a time; the other trainer ranks call
``ShardedSource(state, group).follow()``), or a zero-argument callable returning an iterator
(``StreamSource``: a metadata pass, then tensors bucket by bucket, never the whole model at once),
or a Megatron-Core / TE trainer's tensor-parallel shards (``common.sync.megatron.MegatronTPSource``:
gathered over the TP group per bucket and undone from Megatron's layouts).

``update_weights`` pauses generation, validates the manifest on every rank, streams the
buckets through the engine's own loaders, collects each rank's local checks, decides byte
identity against the learner's own bytes, commits or rolls back on every rank, checks that
all ranks serve the same version, flushes the prefix cache and probes it, runs the
end-to-end logprob probe, and resumes.  The returned :class:`SyncReport` has one result per
condition.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Iterable, Mapping, Optional

import torch

from ..quantize import quantize_rows
from .sources import TrainerSource, as_source
from .manifest import Manifest
from .recorder import backup_mode
from .report import CheckResult, SyncReport
from .fingerprints import fingerprint_regions
from .transport import run_beside

HIGH = (torch.bfloat16, torch.float16, torch.float32)


class LearnerTruth:
    """The learner's own bytes for each (name, role): what byte identity compares against.

    For ``bf16`` updates the on-grid bytes are TE's quantization of the BF16 weights (the same
    function the engine ran, but computed here); ``mxfp8`` tensors are their own truth.  An
    explicit mapping (e.g. TE's ``_rowwise_data`` / unswizzled scales) overrides both.
    """

    def __init__(self, named: Mapping[str, torch.Tensor], explicit: Optional[Mapping[str, torch.Tensor]] = None):
        self.named, self.explicit, self._q = named, explicit or {}, {}

    def get(self, name: str, role: str) -> Optional[torch.Tensor]:
        if (name, role) in self.explicit:
            return self.explicit[(name, role)]
        if name in self.explicit and role != "scale":
            return self.explicit[name]
        t = self.named.get(name)
        if t is None or t.dtype not in HIGH or role == "plain":
            return t
        if name not in self._q:
            self._q[name] = quantize_rows(t)
        return self._q[name][0].view(torch.float8_e4m3fn) if role == "data" else self._q[name][1]


class GridSyncClient:

    def __init__(self, transport, digest: str = "sampled", fraction: float = 0.05, backup: bool | str = True,
                 bucket_bytes: int = 256 << 20, probe_prompts: Optional[list] = None,
                 learner_logprobs: Optional[Callable[[list], list]] = None, probe_tolerance: float = 2e-3,
                 cache_probe_prompt: Optional[list] = None, probe_stat: str = "max"):
        self.t = transport
        self.digest, self.fraction, self.backup, self.bucket_bytes = digest, fraction, backup, bucket_bytes
        self.replay = True                # ranks may replay their write plan (common/sync/plan.py); False: loaders
        self.probe_prompts, self.learner_logprobs, self.probe_tolerance = probe_prompts, learner_logprobs, \
            probe_tolerance
        self.cache_probe_prompt = cache_probe_prompt
        if probe_stat not in ("max", "mean"):
            raise ValueError(f"probe_stat must be 'max' or 'mean'; got {probe_stat!r}")
        self.probe_stat = probe_stat      # "max": float32 engines (accumulation order only); "mean": BF16 ones
        self.version = max(int(s["version"]) for s in self.t.rpc("grid_state"))

    # ----------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                       | Callable[[], Iterable[tuple[str, torch.Tensor]]] | "TrainerSource",
                       format: str = "bf16", version: Optional[int] = None, kv_scales: Optional[dict] = None,
                       partial: bool = False, truth: Optional[Mapping] = None, seed: Optional[int] = None,
                       flush_cache: bool = True, verify: bool = False) -> SyncReport:
        src = as_source(named_tensors)                  # dict / FSDP2 DTensors / stream; fused experts split
        try:
            return self._update(src, format, version, kv_scales, partial, truth, seed, flush_cache, verify)
        finally:
            src.close()                                 # releases the other trainer ranks (sharded sources)

    def _update(self, src, format, version, kv_scales, partial, truth, seed, flush_cache, verify) -> SyncReport:
        if verify:
            version = self.version
        version = int(version if version is not None else self.version + 1)
        manifest = Manifest.of_specs(src.metadata(), version, format, partial,
                                     {str(k): [float(a), float(b)] for k, (a, b) in (kv_scales or {}).items()} or None)
        opts = {"backup": self.backup if not verify else (self.backup or "host"), "digest": self.digest,
                "fraction": self.fraction, "seed": version if seed is None else seed, "verify": bool(verify),
                "replay": bool(self.replay)}
        report = SyncReport(version=version, applied=False)
        timings = report.timings
        t_all = time.perf_counter()
        if flush_cache and self.cache_probe_prompt and hasattr(self.t, "cached_tokens"):
            self.t.cached_tokens(self.cache_probe_prompt)             # put the probe prefix in the cache
        self.t.pause()
        paused = True
        committed = False
        try:
            t0 = time.perf_counter()
            self.t.rpc("grid_update_begin", manifest.to_json(), json.dumps(opts))
            for bucket in src.buckets(self.bucket_bytes):
                self._load_bucket(bucket)
                del bucket                              # one bucket alive while the next is made
            timings["transfer_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            ranks = [SyncReport.from_dict(d) for d in self.t.rpc("grid_update_finish")]
            timings["engine_checks_s"] = time.perf_counter() - t0
            for key in sorted({k for r in ranks for k in r.timings}):     # the slowest rank's phases
                timings[f"rank_{key}"] = max(float(r.timings.get(key, 0.0)) for r in ranks)
            for r in ranks:
                report.checks += r.checks
                if r.error:
                    report.error = (report.error + "; " if report.error else "") + f"rank {r.extra.get('rank')}: {r.error}"
            regions = [reg for r in ranks for reg in r.extra.get("regions", [])]
            t0 = time.perf_counter()
            problems = []
            by_source: dict = {}
            for r in regions:
                by_source.setdefault(r[0], []).append(r)
            for name, t in src.lookup(sorted(by_source)):          # one tensor at a time for streams
                problems += fingerprint_regions(LearnerTruth({name: t}, truth).get, by_source.pop(name))
            for name, regs in by_source.items():                    # asked for, never found
                problems += fingerprint_regions(LearnerTruth({}, truth).get, regs)
            identity_ok = (not problems) if regions else None
            report.checks.append(CheckResult("byte_identity", identity_ok,
                                             problems or ([f"{len(regions)} regions compared ({self.digest})"]
                                                          if self.digest != "off" else
                                                          ["not checked (digest='off')"]),
                                             time.perf_counter() - t0))
            accept = report.error is None and not report.failed() and not verify
            commits = self.t.rpc("grid_update_commit", "1" if accept else "0")
            if verify:                    # the engine keeps what it held: the replay was rolled back
                report.extra["verified"] = report.error is None and not report.failed()
                report.checks.append(self._versions(self.version))
                self.t.resume()
                paused = False
                report.rolled_back = True
                timings["total_s"] = time.perf_counter() - t_all
                return report
            report.applied = accept and all(c["applied"] for c in commits)
            committed = report.applied
            report.rolled_back = not report.applied
            report.checks.append(self._versions(version if report.applied else self.version))
            if report.applied:
                self.version = version
                if flush_cache:
                    self.t.reset_prefix_cache()
            self.t.resume()
            paused = False
            if report.applied:
                report.checks.append(self._cache_probe())
                report.checks.append(self._logprob_probe())
        except Exception as exc:
            try:
                if paused and not committed:
                    for r in self.t.rpc("grid_update_abort"):
                        if r.get("check"):
                            report.checks.append(CheckResult(**r["check"]))
            finally:
                report.error = f"{type(exc).__name__}: {exc}"
                if committed:             # the new weights serve; what failed came after (flush, probe)
                    report.applied, report.rolled_back = True, False
                    report.checks.append(CheckResult("cache_coherence", False,
                                                     [f"after the commit: {type(exc).__name__}: {exc}"]))
                else:
                    report.applied, report.rolled_back = False, backup_mode(self.backup) != ""
                    report.checks += [CheckResult(cond, False, texts)       # a refusal's problems, as data
                                      for cond, texts in (getattr(exc, "problems", None) or {}).items()]
                report.checks.append(self._versions(self.version))
        finally:
            if paused:
                self.t.resume()
            done = getattr(self.t, "done", None)
            if done is not None:
                done()                      # the staging memory of this update back to the trainer
        timings["total_s"] = time.perf_counter() - t_all
        return report

    def verify_weights(self, named_tensors, format: str = "bf16", kv_scales: Optional[dict] = None,
                       partial: bool = False, truth: Optional[Mapping] = None) -> SyncReport:
        """The seven checks after weights were loaded some other way (a trainer's own
        ``collective_rpc`` + ``model.load_weights``, vLLM's or SGLang's update APIs): the learner's
        tensors are replayed through the engine's loaders under the recorder, every check runs, and
        ``engine_as_found`` compares the bytes the engine held before the replay with the ones the
        checked replay wrote, region by region, plus the derived tensors and KV scales as found.
        The replay is always rolled back: the engine is left holding what it held (its derived
        tensors rebuilt from those bytes).  ``report.extra["verified"]`` is the verdict."""
        return self.update_weights(named_tensors, format=format, kv_scales=kv_scales, partial=partial, truth=truth,
                                   flush_cache=False, verify=True)

    def _load_bucket(self, bucket) -> None:
        src = self.t.stage(bucket)
        try:
            send = getattr(self.t, "send", None)
            if send is None:
                self.t.rpc("grid_update_load", json.dumps(src))
                return
            join = run_beside(self.t.rpc, "grid_update_load", json.dumps(src))
            try:
                send(bucket, src)
            finally:
                join()
        finally:
            self.t.release(src)

    # -- client-side checks ----------------------------------------------------------------
    def _versions(self, want: int) -> CheckResult:
        t0 = time.perf_counter()
        states = self.t.rpc("grid_state")
        problems = [f"rank {s['rank']} serves version {s['version']}, expected {want}" for s in states
                    if int(s["version"]) != want]
        problems += [f"rank {s['rank']}: torn (a failed update without backup); keep generation paused"
                     for s in states if s.get("torn")]
        return CheckResult("atomic_versioning", not problems, problems, time.perf_counter() - t0)

    def _cache_probe(self) -> CheckResult:
        t0 = time.perf_counter()
        if not self.cache_probe_prompt or not hasattr(self.t, "cached_tokens"):
            return CheckResult("cache_coherence", None, ["no cache probe prompt (longer than a KV block)"], 0.0)
        cached = self.t.cached_tokens(self.cache_probe_prompt)
        ok = cached == 0
        return CheckResult("cache_coherence", ok, ["no prompt token of the probe came from the prefix cache"]
                           if ok else [f"the first request after the update reused {cached} cached prompt tokens "
                                       "computed with the old weights (prefix cache not flushed)"],
                           time.perf_counter() - t0)

    def _logprob_probe(self) -> CheckResult:
        t0 = time.perf_counter()
        if not (self.probe_prompts and self.learner_logprobs and hasattr(self.t, "prompt_logprobs")):
            return CheckResult("probe", None, ["no probe prompts / learner forward given"], 0.0)
        got, _ = self.t.prompt_logprobs(self.probe_prompts)
        want = self.learner_logprobs(self.probe_prompts)
        d = [abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)]
        diff = max(d) if self.probe_stat == "max" else sum(d) / len(d)
        ok = diff <= self.probe_tolerance
        return CheckResult("probe", ok, [f"{self.probe_stat} |logprob diff| vs the learner's grid forward: {diff:.2e} "
                                         f"(tolerance {self.probe_tolerance})"], time.perf_counter() - t0)
