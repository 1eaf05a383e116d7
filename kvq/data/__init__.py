"""kvq.data: text sources (`text`, no torch) and reproducible token windows (`windows`)."""
