"""The heartbeat functions, shared with worker_site/elasticd_heartbeat.py (the worker
contract, see elasticd/workers/contract.py): one module, one rate limiter."""
from ..workers.contract import beats as _hb

heartbeat = _hb.heartbeat
keepalive = _hb.keepalive
last_beat = _hb.last_beat
current_phase = _hb.current_phase
elasticd_section = _hb.elasticd_section
steps = _hb.steps
