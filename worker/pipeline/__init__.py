"""The stages a job goes through"""
