"""Stage 4, training: arguments for ``Trainer`` that follow the plan and the device.

``arguments`` builds ``TrainingArguments`` (precision, device, backend) for a loaded model.
"""
