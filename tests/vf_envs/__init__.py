"""Two small environments in verifiers' classic shape, written for the tests.

`colour` is one turn with a local rubric (the trainer recomputes its
reward); `lookup` is several turns with a tool, whose results the trainer
cannot check. `loop.py` is the shape both share: a dataset of rows, an
async `rollout` that calls the model through the OpenAI client it is
given, and a rubric.
"""
