"""The slipstream command-line tool."""
