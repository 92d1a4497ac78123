"""GLUE data readers (`glue`) and task metrics (`metrics`)."""
