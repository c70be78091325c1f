"""Built-in tasks: data, verifier, tokenizer and initial model, all built locally.

`arithmetic` (integer addition and subtraction with worked answers) is the task treadle's demo
and end-to-end tests train on; `treadle prepare` writes it to a directory. Its verifier is the
built-in reward `arithmetic` (see `treadle.rewards`).
"""
