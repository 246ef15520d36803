"""A logging handler that keeps the messages it sees (llama.cpp's log reaches Python as logger specq.llama)."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())
