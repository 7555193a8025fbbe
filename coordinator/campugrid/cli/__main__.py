from campugrid.cli.main import app

app()
