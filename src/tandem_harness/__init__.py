"""tandem's in-process verifiers harness under an id verifiers can load: `harness={"id": "tandem_harness"}` (verifiers
imports a plugin id as a top-level module). The harness itself is tandem.integrations.verifiers_harness.ChatHarness."""

from tandem.integrations.verifiers_harness import ChatHarness

__all__ = ["ChatHarness"]
