"""The shared base: what every process of a federation uses and nothing above it may change.

The wire contract (`wire`), the config file (`config`), the tokenizer (`tokens`), the GPU
performance models (`gpus`), the pure routing math (`policy`, `work`), errors, credentials,
logging and the process runtime. It imports nothing of ours but `proto`; the control plane
(`scheduler`), the site side (`nodes`), the front door (`federation.gateway`) and the
operator's tools (the rest of `federation`) stand on it. `tests/test_layers.py` holds the floors.
"""
