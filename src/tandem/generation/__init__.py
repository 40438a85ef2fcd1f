"""The client side of generation: the vLLM-protocol clients (`client.py`), what a server says about itself at
connect (`server_facts.py`), and `tandem serve` / `tandem proxy` started as subprocesses (`launcher.py`)."""
