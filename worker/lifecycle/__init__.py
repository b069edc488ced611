"""Start-up, the main loop and shutdown"""
