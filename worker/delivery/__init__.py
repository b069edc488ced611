"""Redis in and out"""
