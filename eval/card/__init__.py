"""Model cards with evaluation results (`huggingface_hub`), and the hand-off to kvpress presses."""
