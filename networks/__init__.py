"""Network modules selectable with ``--network_module`` (sd-scripts' protocol).

* ``networks.lora``: LoRA / LoCon for SD1.x/2.x, kohya keys (``lora_unet_*``, ``lora_te_*``).
* ``networks.lora_fa``: LoRA-FA (frozen ``lora_down``, only ``lora_up`` trained), keys as ``networks.lora``.
* ``networks.lycoris_adapter``: ``lycoris.kohya`` (LoCon, LoHa, LoKr, ...) with kohya-compatible text-encoder names
  and sd-scripts' save format. ``NETWORK_MODULE_ALIASES`` maps the name a user gives to the module to import.
"""

NETWORK_MODULE_ALIASES = {"lycoris.kohya": "networks.lycoris_adapter"}
