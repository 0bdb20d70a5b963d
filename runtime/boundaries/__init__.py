"""What crosses a stage boundary: pytrees, shapes, signatures and their discovery."""
