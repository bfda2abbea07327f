"""The daemon's one settings object.

Every timeout, interval, TTL and limit lives here as a named field with a
default. Values come, later ones winning, from: the defaults, the TOML
file (``/etc/elasticd/elasticd.toml`` or ``--config``), ``ELASTICD_<SECTION>_<FIELD>``
environment variables, and command-line flags. ``load()`` validates the result
and raises :class:`ConfigError` naming every bad field at once.

Where each part lives: the sections' fields in node.py ([daemon], [etcd],
[cluster], [membership], [rendezvous]), agent.py ([agent]), service.py
([control], [limits], [metrics], [events], [retention], [snapshot])
and workers/inprocess_settings.py ([inprocess]); ``Config`` and ``SECTIONS`` in model.py;
loading and checking each field in loading.py; the rules between fields in
rules.py; the sample file, ``--help-config`` and ``documented()`` in sample.py.
A setting's documentation is its field's ``setting(...)`` call (settingfield.py):
``dataclasses.fields(SECTIONS[section])`` gives each field, ``field.metadata``
its help text and bounds.
"""
from ..workers.inprocess_settings import InprocessSettings
from .agent import AgentSettings
from .loading import (DEFAULT_CONFIG_PATH, ENV_PREFIX, ConfigError, default_paths,
                      default_socket_path, load, socket_gid)
from .model import SECTIONS, Config
from .node import (ClusterSettings, DaemonSettings, EtcdSettings, MembershipSettings,
                   RendezvousSettings)
from .sample import describe, sample_toml
from .service import (ControlSettings, EventsSettings, LimitsSettings, MetricsSettings,
                      RetentionSettings, SnapshotSettings)

__all__ = ["AgentSettings", "ClusterSettings", "Config", "ConfigError", "ControlSettings",
           "DaemonSettings", "DEFAULT_CONFIG_PATH", "ENV_PREFIX", "EtcdSettings",
           "EventsSettings", "InprocessSettings", "LimitsSettings", "MembershipSettings",
           "MetricsSettings", "RendezvousSettings", "RetentionSettings", "SECTIONS",
           "SnapshotSettings", "default_paths", "default_socket_path", "describe", "load",
           "sample_toml", "socket_gid"]
