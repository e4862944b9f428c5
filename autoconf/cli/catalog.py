"""``autoconf models`` and ``autoconf devices``: the presets and the device catalog.
"""

from __future__ import annotations

from autoconf.cli.common import _print_json


def cmd_models(args) -> int:
    from autoconf.specs.model import preset, preset_names
    rows = [preset(n) for n in preset_names()]
    if args.json:
        _print_json([{**m.to_dict(), "num_params": m.num_params()} for m in rows])
        return 0
    from autoconf.output.tables import models_table, show
    show(models_table(rows))
    return 0


def cmd_devices(args) -> int:
    from autoconf.specs.devices import device_names, device_type
    rows = [device_type(n) for n in device_names()]
    if args.json:
        _print_json([d.to_dict() for d in rows])
        return 0
    from autoconf.output.tables import devices_table, show
    show(devices_table(rows))
    return 0
