"""Watching the worker"""
