"""A torch-to-nnef ``TractNNEF`` target that neither downloads nor runs a tract binary.

``TractNNEF(version)`` fetches the tract command-line binary from the internet even with
``check_io=False``, then asks it for its version. Its public ``specific_tract_binary_path``
parameter skips the download; we point it at a throw-away stand-in script that only answers
``--version`` with the requested release. With ``check_io=False`` torch-to-nnef never calls
the binary again, so the script is deleted as soon as the target is built. No file of
torch-to-nnef is touched. Checking the export is done with the ``tract`` Python package
(``gdn_fx.tract_check``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Mapping, Optional

from torch_to_nnef.inference_target import TractNNEF

from gdn_fx.lowering.target import parse_version, version_text


def _stand_in(folder: Path, version: str) -> Path:
    script = folder / "tract"
    script.write_text(f'#!/bin/sh\necho "tract {version}"\n')
    script.chmod(0o755)
    return script


def offline_tract_target(version: str, dynamic_axes: Optional[Mapping] = None,
                         properties: Optional[Mapping[str, str]] = None) -> TractNNEF:
    """A TractNNEF target for ``version`` that never touches the network.

    ``dynamic_axes`` is torch-to-nnef's ``{input_name: {axis: symbol}}``; ``properties`` are
    written into the NNEF as tract properties. Identity properties (host, user) are not.
    """
    version = version_text(parse_version(version))
    with tempfile.TemporaryDirectory(prefix="gdn_fx_tract_") as folder:
        return TractNNEF(
            version,
            check_io=False,
            specific_tract_binary_path=_stand_in(Path(folder), version),
            dynamic_axes=dict(dynamic_axes or {}),
            specific_properties=dict(properties or {}),
            dump_identity_properties=False,
        )
