"""The `--help` layout of every `dual-decoder` command: each option's help followed by its default."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's `ArgumentDefaultsHelpFormatter`, without the noise: no "(default: …)" after a required option, a
    flag, an option whose default is None (its help says what None means) or a help text that names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.required or not action.option_strings or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or "default" in text.lower()):
            return text
        return super()._get_help_string(action)
