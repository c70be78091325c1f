"""Built-in tasks: data, verifier, tokenizer and initial model, all built locally.

`arithmetic` (integer addition and subtraction with worked answers) is the task treadle's demo
and end-to-end tests train on; `treadle prepare` writes it to a directory. Its verifier is the
built-in reward `arithmetic` (see `treadle.rewards.functions`). `shapes` (count the shapes in a
picture) is the image task, with a tiny Idefics3 vision-language model and its processor.
"""

# `treadle prepare --task NAME`: NAME -> "module:function(out_dir, *, seed) -> {name: path}"
PREPARERS: dict[str, str] = {
    "arithmetic": "treadle.tasks.arithmetic:prepare",
    "chat_arithmetic": "treadle.tasks.chat_arithmetic:prepare_chat",
    "calculator": "treadle.tasks.calculator:prepare",
    "code": "treadle.tasks.code:prepare",
    "shapes": "treadle.tasks.shapes:prepare",
}
