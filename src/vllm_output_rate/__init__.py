"""Per-user output-token rate limiting for vLLM, as a plugin.

Layers:

* policy -- :mod:`.policy` (GCRA, the per-step gate, eviction, the monitor);
  plain Python, no vLLM import;
* adapter -- :mod:`.adapter` (scheduler subclasses, named vLLM patches);
* tools -- :mod:`.tools` (CLI, tiny model, bench).

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in every
process it starts.
"""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point: check the vLLM version, install patches.

    Refuses (raises) on a vLLM release this plugin does not support, so a
    mismatched install fails at startup instead of misbehaving.
    """
    from vllm_output_rate.adapter.compat import require_supported_vllm
    from vllm_output_rate.adapter.patches import apply_all

    require_supported_vllm()
    apply_all()
