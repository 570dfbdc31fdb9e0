"""The Qwen-Image MMDiT family: Qwen-Image-Edit (v1), -2509, -2511 and the text-to-image Qwen-Image / 2512."""
