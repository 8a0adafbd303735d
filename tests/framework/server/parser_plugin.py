"""A component-only plugin contributing a tool parser (test_parsers loads it as an entry point)."""

from portaserve.framework.hookspecs import hookimpl
from portaserve.framework.server.parsers.base import ToolDelta, ToolParser

PORTASERVE_CONTRACT = "1.0"


class UpperParser(ToolParser):
    name = "upper"

    def extract(self, text):
        return text.upper() or None, []

    def feed(self, delta):
        return ToolDelta(delta.upper())

    def finish(self):
        return ToolDelta()


@hookimpl
def portaserve_tool_parsers():
    return {"upper": UpperParser}
