import django.db.models.deletion
from django.db import migrations, models


def stock(apps, schema_editor):
    Stock = apps.get_model("orders", "Stock")
    Stock.objects.bulk_create([Stock("widget", 10), Stock("gadget", 1)])


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Stock",
            fields=[
                ("item", models.CharField(max_length=100, primary_key=True, serialize=False)),
                ("available", models.PositiveIntegerField()),
            ],
        ),
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("quantity", models.PositiveIntegerField()),
                ("status", models.CharField(default="pending", max_length=20)),
                ("run_id", models.UUIDField(null=True)),
                (
                    "item",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, to="orders.stock"
                    ),
                ),
            ],
        ),
        migrations.RunPython(stock, migrations.RunPython.noop),
    ]
