"""The settings object: ``Config``, one frozen section per TOML table (``SECTIONS``).

The sections are declared in config/node.py, config/agent.py, config/service.py
and workers/inprocess_settings.py; this module puts them together in the order the
sample file and the docs list them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..workers.inprocess_settings import InprocessSettings
from .agent import AgentSettings
from .node import (ClusterSettings, DaemonSettings, EtcdSettings, MembershipSettings,
                   RendezvousSettings)
from .service import (ControlSettings, EventsSettings, LimitsSettings, MetricsSettings,
                      RetentionSettings, SnapshotSettings)


SECTIONS: dict[str, type] = {
    "daemon": DaemonSettings,
    "etcd": EtcdSettings,
    "cluster": ClusterSettings,
    "membership": MembershipSettings,
    "rendezvous": RendezvousSettings,
    "agent": AgentSettings,
    "inprocess": InprocessSettings,
    "control": ControlSettings,
    "limits": LimitsSettings,
    "metrics": MetricsSettings,
    "events": EventsSettings,
    "retention": RetentionSettings,
    "snapshot": SnapshotSettings,
}


@dataclass(frozen=True)
class Config:
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    membership: MembershipSettings = field(default_factory=MembershipSettings)
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    inprocess: InprocessSettings = field(default_factory=InprocessSettings)
    control: ControlSettings = field(default_factory=ControlSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    events: EventsSettings = field(default_factory=EventsSettings)
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    snapshot: SnapshotSettings = field(default_factory=SnapshotSettings)
    source: str = ""  # which file, if any, was read

    @property
    def cred_socket(self) -> str:
        return self.daemon.socket + ".cred"

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.daemon.state_dir, "logs")

    @property
    def jobs_run_dir(self) -> str:
        """Where each job gets a dir its user writes error files and progress
        beats into: beside the control socket (a dir users can reach), not in
        the state dir (root's alone)."""
        return os.path.join(os.path.dirname(self.daemon.socket), "jobs")
