"""labkit.exercises"""
