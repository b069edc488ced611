"""worker top"""
