"""One job's worker template on this node, and what its record says of it.

``JobTemplate`` owns the job's ``WorkerTemplate`` (workers/template.py): taken
from the node's pool (an idle one of the user's with an equal key) or started
as soon as the job is here, its state, reason and RSS written into the job's
record as they change, handed back to the pool when the job ends here; and,
after local rank 0's first beat, the modules it imported (the job's next
template preloads them); and, each round, how its ranks started (template,
spare or cold, and why not from the template). The agent asks it whether the
template is ready.
"""
from __future__ import annotations

import threading
from typing import Callable

from ..config import Config
from ..jobs.registry import JobRecord, JobRegistry
from ..jobs.states import TERMINAL_STATES
from ..workers import preload
from ..rendezvous.protocol import Result
from ..workers.group import GroupSpec, WorkerGroup
from ..workers.template import StartPath, TemplateState, WorkerTemplate
from ..workers.template_pool import TemplatePool


class JobTemplate:
    def __init__(self, job_id: str, cfg: Config, registry: JobRegistry, pool: TemplatePool):
        self.job_id = job_id
        self._cfg = cfg
        self._registry = registry
        # The node's templates kept between a user's jobs (owned by the coordinator);
        # this job's is taken from it or started at ``start``, handed back at ``release``.
        self._pool = pool
        a = cfg.agent
        self.template = WorkerTemplate(job_id, cfg.daemon.node_id, a.template_ready_timeout,
                                       a.template_fork_timeout)
        self._noted: tuple = ()      # (state, reason, rss) last written to the record
        self._said = ""              # where it came from, when not started for this job
        self.preload_read = False    # the learned preload was read (once per job)

    @property
    def on(self) -> bool:
        return self._cfg.agent.worker_template

    def start(self, node_spec: Callable[[JobRecord], GroupSpec],
              stop: threading.Event | None = None) -> None:
        """The job's template as soon as the job is here, ready for its first start: an
        idle one of this user's with an equal key (workers/template_pool.py), or a new one.
        A set ``stop`` (a cancel, the job's end elsewhere) cuts short a wait for an idle
        one's imports."""
        job = self._registry.get(self.job_id)
        if not self.on or job.state in TERMINAL_STATES:
            return
        got = self._pool.acquire(self.job_id, node_spec(job),
                                 learned=job.learned_preload[:self._cfg.agent.template_preload_max],
                                 stop=stop)
        self.template = got.template
        if got.reused:
            t = got.template
            rss = t.rss_bytes()
            self._said = got.sentence()
            self._noted = (t.state.value, "", rss)
            self._registry.event(self.job_id, "template", got.sentence())
            self._registry.update(self.job_id, template_state=t.state.value,
                                  template_reason=got.sentence(), template_rss_bytes=rss)
            return
        self.note()

    def current(self) -> WorkerTemplate | None:
        """The job's template now (a revived one replaces the last), None when off."""
        return self.template if self.on else None

    def ready_for_round(self, node_spec: Callable[[JobRecord], GroupSpec],
                        wake: threading.Event) -> bool:
        """Before a round's ranks start: a new template if the last died after serving
        ranks (it took them with it), and a wait for one still importing (bounded by its
        ready timeout); False when ``wake`` (a cancel, a shutdown, the job's end) ended
        the wait: then no ranks start."""
        if self.template.revivable():
            self._registry.event(self.job_id, "template", "starting a new worker "
                                 f"template: {self.template.reason}")
            self.start(node_spec)
        if self.template.state is TemplateState.STARTING:
            self.template.ready(stop=wake)
            self.note()
            return not wake.is_set()
        return True

    def release(self, keep: bool) -> None:
        """The job ended here (or the daemon stops: not ``keep``): its template back to
        the pool, kept idle for the user's next job or stopped (workers/template_pool.py)."""
        said = self._pool.release(self.template, keep=keep)
        if not self.on:
            return
        if said:
            self._registry.event(self.job_id, "template", said)
            kept = self.template.state is TemplateState.READY  # in the pool, idle
            self._registry.update(self.job_id, template_state=(
                TemplateState.POOLED if kept else TemplateState.STOPPED).value,
                template_reason=said, template_rss_bytes=0)
            return
        self.note()  # it had failed (or was never made): as it is

    def note(self) -> None:
        """The template's state, reason and RSS into the job's record (when they changed:
        the RSS by a tenth or more); an event when it became unusable."""
        t = self.template
        if not self.on:
            return
        t.ready(0)
        rss = t.rss_bytes()
        state, reason, old_rss = self._noted or ("", "", 0)
        if (t.state.value, t.reason) == (state, reason) and abs(rss - old_rss) * 10 <= old_rss:
            return
        self._noted = (t.state.value, t.reason, rss)
        if t.state is TemplateState.FAILED and t.state.value != state:
            self._registry.event(self.job_id, "template", f"worker template unusable: "
                                 f"{t.reason}; ranks start cold")
        elif t.state is TemplateState.READY and t.state.value != state:
            self._registry.event(self.job_id, "template", f"worker template ready in "
                                 f"{t.ready_seconds:.2f} s (pid {t.pid}, "
                                 f"{rss / (1 << 20):.0f} MiB)", duration=t.ready_seconds)
        self._registry.update(self.job_id, template_state=t.state.value,
                              template_reason=t.reason or self._said,
                              template_rss_bytes=rss)

    def learn_preload(self, spec: GroupSpec) -> None:
        """After the first beat: what local rank 0 imported, for the job's next template."""
        a = self._cfg.agent
        if not a.worker_template or not a.template_preload_max:
            self.preload_read = True
            return
        names = preload.read_report(spec.run_dir, spec.uid, a.template_preload_max,
                                    already={n.split(".")[0] for n in a.warm_preload})
        if names is None:
            return  # not written yet (its first step is still to come)
        self.preload_read = True
        if names and names != self._registry.get(self.job_id).learned_preload:
            self._registry.update(self.job_id, learned_preload=names)
            self._registry.event(self.job_id, "template", "learned preload: "
                                 f"{', '.join(names)} (the job's next worker template "
                                 "imports them)")

    def note_start(self, group: WorkerGroup, result: Result) -> None:
        """The event and record of how this round's ranks started, and how long it took."""
        order = [StartPath.COLD.value, StartPath.SPARE.value, StartPath.TEMPLATE.value]
        paths = [w.start_path for w in group.workers]
        slowest = min(paths, key=order.index) if paths else StartPath.COLD.value
        counts = ", ".join(f"{paths.count(p)} {p}" for p in reversed(order) if p in paths)
        why = next((w.cold_reason for w in group.workers if w.cold_reason), "")
        if not why and self.template.state is TemplateState.OFF and self.template.reason:
            why = f"no worker template: {self.template.reason}"
        self._registry.event(
            self.job_id, "start", f"round {result.place.round}: {len(paths)} rank(s) started in "
            f"{group.start_seconds:.3f} s ({counts})" + (f"; not from the template: {why}"
                                                          if why else ""),
            duration=group.start_seconds, start_path=slowest)
        self._registry.update(self.job_id, start_path=slowest,
                              start_seconds=group.start_seconds)
        self.note()
