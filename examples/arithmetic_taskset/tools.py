"""The taskset's tool server: tandem's calculator over MCP (verifiers launches it as `python -m arithmetic_taskset.tools`)."""

import verifiers.v1 as vf

from tandem.tasks.tools import calculator as add_and_subtract


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # advertised as `calculator`, the name the tiny model knows

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Add and subtract integers.

        Args:
            expression: Integers joined by + and - signs.
        """
        return add_and_subtract(expression)


if __name__ == "__main__":
    CalculatorToolset.run()
