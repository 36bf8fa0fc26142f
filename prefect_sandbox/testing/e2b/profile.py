"""The IPython profile of the code-interpreter template, for the emulator's kernels.

E2B's ``code-interpreter`` template (e2b-dev/code-interpreter, ``template/``) puts in the
kernel's ``profile_default``: an ``ipython_kernel_config.py`` that turns colours off (tracebacks
carry no ANSI codes) and lifts the cut of long sequences in ``text/plain``; and startup scripts
that add an ``application/json`` part (metadata ``{"expanded": true}``) to every displayed dict
or list, an ``e2b/data`` part to every displayed pandas DataFrame (columns as lists, timestamps
in ISO format), and a ``display_data`` of the image to every ``PIL.Image.save(path)``. The
emulator writes the same behaviour (our own code) into each sandbox's IPython folder. The
template's ``e2b/chart`` part needs E2B's ``e2b_charts`` package and is left out.
Manual: docs/backends/e2b.md.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_template_profile"]

_KERNEL_CONFIG = """\
c = get_config()  # noqa
c.InteractiveShell.colors = "NoColor"
c.PlainTextFormatter.max_seq_length = 0
"""

_FORMATTERS = """\
def _e2b_template_formatters():
    import json
    import sys

    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter, JSONFormatter
    from traitlets import ObjectName, Unicode

    class ExpandedJSON(JSONFormatter):
        def __call__(self, obj):
            if isinstance(obj, (list, dict)):
                try:
                    return json.loads(json.dumps(obj, default=_plain)), {"expanded": True}
                except (TypeError, ValueError):
                    pass
            return super().__call__(obj)

    def _plain(value):
        tolist = getattr(value, "tolist", None)
        if tolist is None:
            raise TypeError(type(value).__name__)
        return tolist()

    class DataFrameData(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj):
            pandas = sys.modules.get("pandas")
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            columns = obj.to_dict(orient="list")
            return {
                name: [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
                for name, values in columns.items()
            }

    formatter = get_ipython().display_formatter
    formatter.formatters["application/json"] = ExpandedJSON(parent=formatter)
    formatter.formatters["e2b/data"] = DataFrameData(parent=formatter)


_e2b_template_formatters()
del _e2b_template_formatters
"""

_IMAGES = """\
def _e2b_template_images():
    try:
        from PIL import Image, ImageShow
    except ImportError:
        return
    from IPython.display import display

    ImageShow.UnixViewer.show_file = lambda self, path, **options: 0
    save = Image.Image.save

    def displayed_save(image, fp, format=None, **params):
        if isinstance(fp, str):
            display(image)
        return save(image, fp, format, **params)

    Image.Image.save = displayed_save


_e2b_template_images()
del _e2b_template_images
"""


def write_template_profile(ipython_dir: Path) -> None:
    """Write the template's kernel config and startup scripts into an IPython folder.

    Args:
        ipython_dir: the folder a kernel gets as ``IPYTHONDIR``; made if missing.
    """
    profile = ipython_dir / "profile_default"
    startup = profile / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (profile / "ipython_kernel_config.py").write_text(_KERNEL_CONFIG)
    (startup / "0002_data.py").write_text(_FORMATTERS)
    (startup / "0003_images.py").write_text(_IMAGES)
